#include "configs.hpp"

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>

#include "moeblaze/error.hpp"
#include "table.hpp"

namespace moeblaze::tools {

const std::vector<NamedConfig>& named_configs() {
  // Kept identical to docs/DESIGN.md's "Named benchmark configs" table; benchmark result files
  // refer to these names, so a shape never changes under an existing name.
  static const std::vector<NamedConfig> configs = {
      {"mb-conf1", 65536, 512, 2048, 4, 1, "MoEBlaze Table 1 (n = 4d)"},
      {"mb-conf3", 65536, 1024, 4096, 16, 4, "MoEBlaze"},
      {"mb-conf4", 32768, 2048, 8192, 16, 4, "MoEBlaze"},
      {"mb-conf7", 8192, 2048, 8192, 8, 4, "MoEBlaze"},
      {"sm-1.4B-n256", 40960, 768, 256, 128, 8, "SonicMoE fig."},
      {"sm-7B-n256", 24576, 1536, 256, 128, 8, "SonicMoE"},
      {"sm-7B-n1024", 24576, 1536, 1024, 32, 2, "SonicMoE"},
      {"sm-30B-n512", 32768, 4096, 512, 128, 8, "SonicMoE"},
      {"sm-default", 32768, 4096, 1024, 128, 8, "SonicMoE benchmark default"},
      {"olmoe", 16384, 2048, 1024, 64, 8, "OLMoE-like"},
      {"cpu-default", 2048, 256, 512, 16, 4, "the CLI's embedded default"},
  };
  return configs;
}

const std::vector<NamedConfig>& model_grid() {
  // One routed-expert layer per published MoE model: d = hidden_size, n = the routed experts'
  // intermediate size (moe_intermediate_size where the config has one), E = routed experts,
  // K = experts per token. Shared experts and dense layers are left out (not grouped GEMMs).
  // T: a per-GPU batch in 8192..32768 tokens, smaller where d and n are large; three T are not
  // multiples of 128 (tile tails in every GEMM). Each line says where its numbers were read;
  // "(unverified: ...)" marks a number not read from the model's config.json or a copy of it.
  // kimi-k2's and llama-4-maverick's bf16 weights and their gradients take 68 and 64 GB at full
  // E: on an 80 GiB GPU such a row may run out of memory, which bench reports and goes on. Names are never reused for
  // another shape; bench/model_shapes.py must list the same rows (python/tests checks it).
  static const std::vector<NamedConfig> grid = {
      // transformers' MixtralConfig defaults (its checkpoint mistralai/Mixtral-8x7B-v0.1)
      {"mixtral-8x7b", 16384, 4096, 14336, 8, 2, "Mixtral-8x7B config.json", "Mixtral-8x7B"},
      // mistralai/Mixtral-8x22B-Instruct-v0.1 config.json (a copy in GenZ-LLM-Analyzer's sets)
      {"mixtral-8x22b", 16384, 6144, 16384, 8, 2, "Mixtral-8x22B config.json", "Mixtral-8x22B"},
      // databricks/dbrx-base config.json: d_model, ffn_config.{ffn_hidden_size, moe_num_experts,
      // moe_top_k} (a copy in GenZ-LLM-Analyzer; transformers' DbrxConfig defaults are not DBRX's)
      {"dbrx", 16384, 6144, 10752, 16, 4, "DBRX config.json", "DBRX"},
      // deepseek-ai/DeepSeek-V2-Lite: hidden 2048, moe_intermediate 1408, 64 routed experts
      // (Megatron configs citing its config.json); K = 6 (unverified: the DeepSeek-V2 paper's
      // six routed experts per token, not read from config.json)
      {"deepseek-v2-lite", 32768, 2048, 1408, 64, 6, "DeepSeek-V2-Lite config.json",
       "DeepSeek-V2-Lite"},
      // deepseek-ai/DeepSeek-V2: hidden 5120, moe_intermediate 1536, 160 routed experts (as
      // above); K = 6 (unverified: as above)
      {"deepseek-v2", 16384, 5120, 1536, 160, 6, "DeepSeek-V2 config.json", "DeepSeek-V2"},
      // transformers' DeepseekV3Config defaults (= deepseek-ai/DeepSeek-V3 config.json)
      {"deepseek-v3", 16384, 7168, 2048, 256, 8, "DeepSeek-V3 config.json", "DeepSeek-V3"},
      // transformers' Qwen2MoeConfig defaults (its checkpoint Qwen/Qwen1.5-MoE-A2.7B)
      {"qwen1.5-moe-a2.7b", 32768, 2048, 1408, 60, 4, "Qwen1.5-MoE-A2.7B config.json",
       "Qwen1.5-MoE-A2.7B"},
      // Qwen/Qwen2-57B-A14B: 64 experts of 2560 upcycled from Qwen2-7B (hidden 3584) per the
      // Qwen2 report; K = 8 (unverified: not read from config.json). T not a multiple of 128.
      {"qwen2-57b-a14b", 20000, 3584, 2560, 64, 8, "Qwen2-57B-A14B config.json",
       "Qwen2-57B-A14B"},
      // transformers' Qwen3MoeConfig defaults (its checkpoint Qwen/Qwen3-30B-A3B-Base)
      {"qwen3-30b-a3b", 32768, 2048, 768, 128, 8, "Qwen3-30B-A3B config.json", "Qwen3-30B-A3B"},
      // Qwen/Qwen3-235B-A22B: hidden 4096, moe_intermediate 1536, 128 experts, top-8 (slime's
      // model script built from its config.json)
      {"qwen3-235b-a22b", 16384, 4096, 1536, 128, 8, "Qwen3-235B-A22B config.json",
       "Qwen3-235B-A22B"},
      // transformers' Qwen3NextConfig defaults (its checkpoint Qwen/Qwen3-Next-80B-A3B-Instruct)
      {"qwen3-next-80b-a3b", 32768, 2048, 512, 512, 10, "Qwen3-Next-80B-A3B config.json",
       "Qwen3-Next-80B-A3B"},
      // allenai/OLMoE-1B-7B: hidden 2048, intermediate 1024, 64 experts, top-8 (copies of its
      // config.json; transformers' OlmoeConfig default intermediate_size 2048 is not OLMoE's)
      {"olmoe-1b-7b", 32768, 2048, 1024, 64, 8, "OLMoE-1B-7B config.json", "OLMoE-1B-7B"},
      // zai-org/GLM-4.5: hidden 5120, moe_intermediate 1536, 160 routed experts, top-8
      // (Megatron-Bridge's GLM-4.5 page and slime's script, both from its config.json)
      {"glm-4.5", 16384, 5120, 1536, 160, 8, "GLM-4.5 config.json", "GLM-4.5"},
      // transformers' Glm4MoeConfig defaults (= zai-org/GLM-4.5-Air: 4096, 1408, 128, top-8)
      {"glm-4.5-air", 24576, 4096, 1408, 128, 8, "GLM-4.5-Air config.json", "GLM-4.5-Air"},
      // openai/gpt-oss-20b config.json: hidden 2880, intermediate 2880, 32 local experts, 4 per
      // token; clamped SwiGLU with expert biases (swiglu-oai). T not a multiple of 128.
      {"gpt-oss-20b", 30000, 2880, 2880, 32, 4, "gpt-oss-20b config.json", "gpt-oss-20b",
       "swiglu-oai"},
      // transformers' GptOssConfig defaults (= openai/gpt-oss-120b: 128 local experts)
      {"gpt-oss-120b", 16384, 2880, 2880, 128, 4, "gpt-oss-120b config.json", "gpt-oss-120b",
       "swiglu-oai"},
      // moonshotai/Kimi-K2-Instruct: hidden 7168 (its config.json as reported by model
      // inspectors), 384 routed experts, 8 per token; n = 2048 (unverified: the DeepSeek-V3
      // layout it keeps, not read from config.json)
      {"kimi-k2", 8192, 7168, 2048, 384, 8, "Kimi-K2 config.json", "Kimi-K2"},
      // transformers' Llama4TextConfig defaults (its checkpoint meta-llama/Llama-4-Scout-17B-16E)
      {"llama-4-scout", 16384, 5120, 8192, 16, 1, "Llama-4-Scout config.json", "Llama-4-Scout"},
      // meta-llama/Llama-4-Maverick-17B-128E: hidden 5120, expert intermediate 8192, 128
      // experts, top-1 (Megatron scripts from its config.json; every other layer is MoE)
      {"llama-4-maverick", 16384, 5120, 8192, 128, 1, "Llama-4-Maverick config.json",
       "Llama-4-Maverick"},
      // transformers' PhimoeConfig defaults (its checkpoint microsoft/Phi-3.5-MoE-instruct)
      {"phi-3.5-moe", 16384, 4096, 6400, 16, 2, "Phi-3.5-MoE config.json", "Phi-3.5-MoE"},
      // deepseek-ai/deepseek-moe-16b-base config.json (a copy in GenZ-LLM-Analyzer)
      {"deepseek-moe-16b", 32768, 2048, 1408, 64, 6, "DeepSeekMoE-16B config.json",
       "DeepSeekMoE-16B"},
      // transformers' Ernie4_5_MoeConfig defaults (its checkpoint baidu/ERNIE-4.5-21B-A3B-PT).
      // T not a multiple of 128.
      {"ernie-4.5-21b-a3b", 12000, 2560, 1536, 64, 6, "ERNIE-4.5-21B-A3B config.json",
       "ERNIE-4.5-21B-A3B"},
      // MiniMax-M2: transformers' MiniMaxM2Config defaults (unverified: its docstring names
      // another checkpoint; MiniMaxAI/MiniMax-M2's config.json not read)
      {"minimax-m2", 16384, 3072, 1536, 256, 8, "MiniMax-M2 config.json", "MiniMax-M2"},
      // ai21labs/AI21-Jamba-1.5-Mini and -Large config.json (copies in GenZ-LLM-Analyzer)
      {"jamba-1.5-mini", 16384, 4096, 14336, 16, 2, "Jamba-1.5-Mini config.json",
       "Jamba-1.5-Mini"},
      {"jamba-1.5-large", 8192, 8192, 24576, 16, 2, "Jamba-1.5-Large config.json",
       "Jamba-1.5-Large"},
  };
  return grid;
}

const NamedConfig& default_config() { return named_configs().back(); }

const NamedConfig* find_config(const std::string& name) {
  for (const NamedConfig& c : named_configs())
    if (name == c.name) return &c;
  for (const NamedConfig& c : model_grid())
    if (name == c.name) return &c;
  return nullptr;
}

const NamedConfig* shape_config(const std::string& name) {
  long long v[5];
  int used = 0;
  if (std::sscanf(name.c_str(), "T%lld-d%lld-n%lld-E%lld-K%lld%n", &v[0], &v[1], &v[2], &v[3],
                  &v[4], &used) != 5 ||
      used != static_cast<int>(name.size()))
    return nullptr;
  for (long long x : v)
    MOEBLAZE_REQUIRE(x > 0, "config '", name, "': every dimension must be positive");
  MOEBLAZE_REQUIRE(v[4] <= v[3], "config '", name, "': K must be in [1, E]");
  static std::mutex mu;
  static std::deque<std::string> names;  // interned: NamedConfig::name points into them
  static std::deque<NamedConfig> shapes;
  const std::lock_guard<std::mutex> lock(mu);
  for (const NamedConfig& c : shapes)
    if (name == c.name) return &c;
  names.push_back(name);
  shapes.push_back({names.back().c_str(), v[0], v[1], v[2], v[3], v[4], "a shape by name"});
  return &shapes.back();
}

std::vector<const NamedConfig*> select_configs(const std::string& spec) {
  std::vector<const NamedConfig*> configs;
  for (const std::string& name : split_commas(spec)) {
    if (name == "all") {
      for (const NamedConfig& c : named_configs()) configs.push_back(&c);
    } else if (name == "grid") {
      for (const NamedConfig& c : model_grid()) configs.push_back(&c);
    } else {
      const NamedConfig* shape = shape_config(name);
      configs.push_back(shape ? shape : &require_config(name));
    }
  }
  return configs;
}

Slice parse_slice(const std::string& slice) {
  const size_t slash = slice.find('/');
  char* end = nullptr;
  const long i = slash == std::string::npos ? 0 : std::strtol(slice.c_str(), &end, 10);
  const bool i_ok = slash != std::string::npos && end == slice.c_str() + slash;
  const long k = i_ok ? std::strtol(slice.c_str() + slash + 1, &end, 10) : 0;
  MOEBLAZE_REQUIRE(i_ok && *end == '\0' && k >= 1 && k <= 1000 && i >= 1 && i <= k, "--slice (",
                   slice, ") must be i/k with 1 <= i <= k <= 1000");
  return {size_t(i), size_t(k)};
}

const NamedConfig& require_config(const std::string& name) {
  const NamedConfig* c = find_config(name);
  MOEBLAZE_REQUIRE(c != nullptr, "config '", name, "' is not one of: ", config_names(),
                   "; the public-model grid: ", grid_names(), " (or 'list')");
  return *c;
}

std::string config_names() {
  std::string s;
  for (const NamedConfig& c : named_configs()) {
    if (!s.empty()) s += ", ";
    s += c.name;
  }
  return s;
}

std::string grid_names() {
  std::string s;
  for (const NamedConfig& c : model_grid()) {
    if (!s.empty()) s += ", ";
    s += c.name;
  }
  return s;
}

void print_config_list(std::ostream& os) {
  Table t({{"name", Align::left},
           {"T", Align::right},
           {"d", Align::right},
           {"n", Align::right},
           {"E", Align::right},
           {"K", Align::right},
           {"S = T*K", Align::right},
           {"from", Align::left}});
  for (const NamedConfig& c : named_configs())
    t.add_row({c.name, std::to_string(c.T), std::to_string(c.d), std::to_string(c.n),
               std::to_string(c.E), std::to_string(c.K), std::to_string(c.T * c.K), c.source});
  t.print(os);
  os << "\npublic-model grid (--config grid; d, n, E, K from each model's config.json)\n";
  Table g({{"name", Align::left},
           {"T", Align::right},
           {"d", Align::right},
           {"n", Align::right},
           {"E", Align::right},
           {"K", Align::right},
           {"S = T*K", Align::right},
           {"activation", Align::left},
           {"model", Align::left}});
  for (const NamedConfig& c : model_grid())
    g.add_row({c.name, std::to_string(c.T), std::to_string(c.d), std::to_string(c.n),
               std::to_string(c.E), std::to_string(c.K), std::to_string(c.T * c.K),
               c.activation ? c.activation : "swiglu", c.model});
  g.print(os);
}

LayerConfig layer_config(const NamedConfig& c, Activation activation, DType dtype) {
  LayerConfig cfg;
  cfg.T = c.T;
  cfg.d = c.d;
  cfg.n = c.n;
  cfg.E = c.E;
  cfg.K = c.K;
  cfg.activation = activation;
  cfg.dtype = dtype;
  return cfg;
}

}  // namespace moeblaze::tools
