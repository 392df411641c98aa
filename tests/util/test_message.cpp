// The message builder every error goes through (src/util/message.h) and shape_str
// (src/util/tensor_utils.h).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "util/message.h"
#include "util/tensor_utils.h"  // shape_str

// The one message builder (util/message.h): each marker prints what the hand-made concatenations
// it replaced printed, which the word-for-word message tests elsewhere rely on.
TEST(MessageText, MarkersPrintKeyRankShapeAndNumbersAsTheMessagesAlwaysDid) {
  using fsdp::detail::msg;
  using fsdp::detail::quote;
  using fsdp::detail::rank;
  using fsdp::detail::shape;
  const std::string key = "layers.0.weight";  // a std::string: std::quoted must not win
  const std::vector<int64_t> sizes{2, 3};
  const size_t n = 7;
  EXPECT_EQ(msg("load: ", quote(key), " has shape ", shape(sizes), " on ", rank(3), ", ", n,
                " elements of ", at::kFloat, " (", int64_t{-1}, ' ', shape({}), ")"),
            "load: 'layers.0.weight' has shape [2, 3] on rank 3, 7 elements of Float (-1 [])");
  EXPECT_EQ(msg(std::string_view("a"), std::string("b"), "c", at::Device("cpu")), "abccpu");
  EXPECT_EQ(fsdp::detail::shape_str({4}), "[4]");
}
