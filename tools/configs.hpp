// docs/DESIGN.md's named benchmark configurations (T, d, n, E, K), shared by `moeblaze run` and the
// `moeblaze bench` commands so that every result row names its shape the same way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "moeblaze/config.hpp"

namespace moeblaze::tools {

struct NamedConfig {
  const char* name;
  int64_t T, d, n, E, K;
  const char* source;  // where the shape comes from (paper table, model family)
  // The public-model grid only (model_grid()): the model whose config.json gives d, n, E, K
  // (rows carry it as "model"), and its experts' activation where not SwiGLU.
  const char* model = nullptr;
  const char* activation = nullptr;  // nullptr: swiglu
};

// Every named config, in docs/DESIGN.md's order; the last one is the CLI's embedded default.
const std::vector<NamedConfig>& named_configs();

// The public-model grid: one expert layer per published MoE model (d, n, E, K from its
// config.json; T a per-GPU batch in 8192..32768 tokens), selected together by `--config grid`
// and one by one by name. bench/model_shapes.py holds the same list for bench/peers.py.
const std::vector<NamedConfig>& model_grid();

// The embedded default of `moeblaze run`: cpu-default (T=2048, d=256, n=512, E=16, K=4).
const NamedConfig& default_config();

// nullptr when `name` is neither a named config nor a grid config.
const NamedConfig* find_config(const std::string& name);

// Throws InvalidArgument listing the valid names when `name` is unknown.
const NamedConfig& require_config(const std::string& name);

// A shape by name, "T<T>-d<d>-n<n>-E<E>-K<K>" (the name bench rows give a shape off the named
// configs), interned for the process's life; nullptr for a name of another form; InvalidArgument
// naming it for a dimension below 1 or K > E.
const NamedConfig* shape_config(const std::string& name);

// The configs a --config flag names: a comma list of "all" (every named config, in
// docs/DESIGN.md's order), "grid" (the public-model grid, in its order), names (either list's)
// and shapes by name (InvalidArgument listing the valid names for an unknown one).
std::vector<const NamedConfig*> select_configs(const std::string& spec);

// A --slice "i/k" (1 <= i <= k <= 1000): every k-th of a run's shapes from the i-th, so that each
// part of a run split over calls mixes big and small shapes. InvalidArgument naming the flag.
struct Slice {
  size_t i = 1, k = 1;
  template <typename T>
  std::vector<T> of(const std::vector<T>& all) const {
    std::vector<T> part;
    for (size_t j = i - 1; j < all.size(); j += k) part.push_back(all[j]);
    return part;
  }
};
Slice parse_slice(const std::string& slice);

// "mb-conf1, mb-conf3, ..., cpu-default" (the grid's names: grid_names())
std::string config_names();
std::string grid_names();

// The tables printed by `--config list`: the named configs, then the grid with its models.
void print_config_list(std::ostream& os);

// The layer shape of a named config with the given activation and storage dtype.
LayerConfig layer_config(const NamedConfig& c, Activation activation, DType dtype);

}  // namespace moeblaze::tools
