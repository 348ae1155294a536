// moeblaze: Mixture-of-Experts layers whose routing is indexing, not copying.
// One include for the whole public C++ API.
#pragma once

#include "moeblaze/config.hpp"
#include "moeblaze/dtype.hpp"
#include "moeblaze/error.hpp"
#include "moeblaze/expert_parallel.hpp"
#include "moeblaze/layer.hpp"
#include "moeblaze/memory.hpp"
#include "moeblaze/routing.hpp"
#include "moeblaze/routing_plan.hpp"
#include "moeblaze/tensor.hpp"
