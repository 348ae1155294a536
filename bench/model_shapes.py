"""The public-model grid: one routed-expert layer per published MoE model, as tools/configs.cpp's
model_grid() lists it for `moeblaze bench layer --config grid` (python/tests/test_model_shapes.py
checks that both lists agree and are well formed). bench/peers.py takes `--config grid` or any of
these names, and its rows carry the model.

Each row: (name, T, d, n, E, K, model, activation). d = hidden_size, n = the routed experts'
intermediate size, E = routed experts, K = experts per token, read from the model's config.json
(tools/configs.cpp says where, row by row, and marks what was not read from it); T is a per-GPU
batch in 8192..32768 tokens, three of them not multiples of 128. activation is the experts' own:
SwiGLU, or gpt-oss's clamped SwiGLU with biases ("swiglu-oai"); peers.py times every shape with
plain SwiGLU (the peers' common activation), the C++ rows of a gpt-oss shape with swiglu-oai only
when asked (`bench layer --config gpt-oss-20b` without --activation).
"""

GRID = [
    # name                  T      d      n      E    K   model                 activation
    ("mixtral-8x7b",       16384, 4096, 14336,   8,  2, "Mixtral-8x7B",       "swiglu"),
    ("mixtral-8x22b",      16384, 6144, 16384,   8,  2, "Mixtral-8x22B",      "swiglu"),
    ("dbrx",               16384, 6144, 10752,  16,  4, "DBRX",               "swiglu"),
    ("deepseek-v2-lite",   32768, 2048,  1408,  64,  6, "DeepSeek-V2-Lite",   "swiglu"),
    ("deepseek-v2",        16384, 5120,  1536, 160,  6, "DeepSeek-V2",        "swiglu"),
    ("deepseek-v3",        16384, 7168,  2048, 256,  8, "DeepSeek-V3",        "swiglu"),
    ("qwen1.5-moe-a2.7b",  32768, 2048,  1408,  60,  4, "Qwen1.5-MoE-A2.7B",  "swiglu"),
    ("qwen2-57b-a14b",     20000, 3584,  2560,  64,  8, "Qwen2-57B-A14B",     "swiglu"),
    ("qwen3-30b-a3b",      32768, 2048,   768, 128,  8, "Qwen3-30B-A3B",      "swiglu"),
    ("qwen3-235b-a22b",    16384, 4096,  1536, 128,  8, "Qwen3-235B-A22B",    "swiglu"),
    ("qwen3-next-80b-a3b", 32768, 2048,   512, 512, 10, "Qwen3-Next-80B-A3B", "swiglu"),
    ("olmoe-1b-7b",        32768, 2048,  1024,  64,  8, "OLMoE-1B-7B",        "swiglu"),
    ("glm-4.5",            16384, 5120,  1536, 160,  8, "GLM-4.5",            "swiglu"),
    ("glm-4.5-air",        24576, 4096,  1408, 128,  8, "GLM-4.5-Air",        "swiglu"),
    ("gpt-oss-20b",        30000, 2880,  2880,  32,  4, "gpt-oss-20b",        "swiglu-oai"),
    ("gpt-oss-120b",       16384, 2880,  2880, 128,  4, "gpt-oss-120b",       "swiglu-oai"),
    ("kimi-k2",             8192, 7168,  2048, 384,  8, "Kimi-K2",            "swiglu"),
    ("llama-4-scout",      16384, 5120,  8192,  16,  1, "Llama-4-Scout",      "swiglu"),
    ("llama-4-maverick",   16384, 5120,  8192, 128,  1, "Llama-4-Maverick",   "swiglu"),
    ("phi-3.5-moe",        16384, 4096,  6400,  16,  2, "Phi-3.5-MoE",        "swiglu"),
    ("deepseek-moe-16b",   32768, 2048,  1408,  64,  6, "DeepSeekMoE-16B",    "swiglu"),
    ("ernie-4.5-21b-a3b",  12000, 2560,  1536,  64,  6, "ERNIE-4.5-21B-A3B",  "swiglu"),
    ("minimax-m2",         16384, 3072,  1536, 256,  8, "MiniMax-M2",         "swiglu"),
    ("jamba-1.5-mini",     16384, 4096, 14336,  16,  2, "Jamba-1.5-Mini",     "swiglu"),
    ("jamba-1.5-large",     8192, 8192, 24576,  16,  2, "Jamba-1.5-Large",    "swiglu"),
]

# name -> (T, d, n, E, K), the form of torch_reference.CONFIGS
SHAPES = {r[0]: tuple(r[1:6]) for r in GRID}
# name -> the public model the shape is taken from
MODELS = {r[0]: r[6] for r in GRID}
ACTIVATIONS = {r[0]: r[7] for r in GRID}
