"""docs/DESIGN.md's named configs and a few shapes off them, as (T, d, n, E, K): what the Python
benchmarks time by name (bench/torch_reference.py, bench/peers.py, ...). The C++ side's list is
tools/configs.cpp (python/tests/test_model_shapes.py checks that no name is in both this and the
public-model grid). Standard library only: tools that only do arithmetic import it without torch.
"""
# docs/DESIGN.md's named configs (T, d, n, E, K).
CONFIGS = {
    "mb-conf1": (65536, 512, 2048, 4, 1),
    "mb-conf3": (65536, 1024, 4096, 16, 4),
    "mb-conf4": (32768, 2048, 8192, 16, 4),
    "mb-conf7": (8192, 2048, 8192, 8, 4),
    "sm-1.4B-n256": (40960, 768, 256, 128, 8),
    "sm-7B-n256": (24576, 1536, 256, 128, 8),
    "sm-7B-n1024": (24576, 1536, 1024, 32, 2),
    "sm-30B-n512": (32768, 4096, 512, 128, 8),
    "sm-default": (32768, 4096, 1024, 128, 8),
    "olmoe": (16384, 2048, 1024, 64, 8),
    "cpu-default": (2048, 256, 512, 16, 4),
}

# Shapes off the named configs (a wide and a fine-grained family; DeepSeek-V2's layer).
EXTRA_SHAPES = {
    "wide-d7168-E256": (16384, 7168, 2048, 256, 8),
    "fine-n320-E512": (16384, 2048, 320, 512, 10),
    "dsv2-d5120": (16384, 5120, 1536, 160, 6),
}
