// Core pieces: bf16 rounding, tensor validation messages, memory accounting.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/test_util.hpp"
#include "moeblaze/moeblaze.hpp"

namespace moeblaze {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(float(bf16(1.0f + 1.0f / 256)), 1.0f);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up to even.
  EXPECT_EQ(float(bf16(1.0f + 3.0f / 256)), 1.0f + 1.0f / 64);
  EXPECT_TRUE(std::isnan(float(bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(float(bf16(std::numeric_limits<float>::infinity()))));
  const auto v = test::random_normal(1000, test::fresh_seed());
  for (float x : v) EXPECT_LE(std::fabs(round_to_bf16(x) - x), std::fabs(x) * (1.0f / 256));
}

TEST(TensorView, ShapeErrorsNameArgumentAndShapes) {
  float buf[6];
  TensorView t = host_view(buf, {2, 3});
  EXPECT_NO_THROW(require_shape(t, "x", {2, 3}));
  try {
    require_shape(t, "x", {3, 2});
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "x has shape (2, 3), expected (3, 2)");
  }
  try {
    require_dtype(t, "w1", DType::bf16);
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "w1 has dtype fp32, expected bf16");
  }
}

TEST(Memory, BuffersAreAccountedAndPeakIsMeasured) {
  const size_t before = memory_stats(Device::cpu).current;
  PeakScope scope(Device::cpu);
  {
    Buffer a(Device::cpu, 1000);
    Buffer b(Device::cpu, 3000);
    EXPECT_EQ(memory_stats(Device::cpu).current, before + 4000);
  }
  Buffer c(Device::cpu, 500);
  EXPECT_EQ(memory_stats(Device::cpu).current, before + 500);
  EXPECT_EQ(scope.peak_above_start(), 4000u);
}

TEST(LayerConfig, ValidationNamesTheRule) {
  LayerConfig c{16, 8, 8, 8, 9, Activation::swiglu, DType::f32};
  try {
    c.validate();
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "top_k K (9) exceeds num_experts E (8)");
  }
  c.K = 0;
  EXPECT_THROW(c.validate(), InvalidArgument);
  c.K = 2;
  c.T = 0;  // empty batch is valid
  EXPECT_NO_THROW(c.validate());
  EXPECT_THROW(parse_activation("tanh"), InvalidArgument);
  EXPECT_EQ(parse_activation("relu2"), Activation::relu2);
  EXPECT_EQ(parse_activation("swiglu-oai"), Activation::swiglu_oai);
  EXPECT_STREQ(activation_name(Activation::swiglu_oai), "swiglu-oai");
}

}  // namespace
}  // namespace moeblaze
