// The fsdp-ckpt tool (issue 11), run as a user runs it: inspect and verify a checkpoint saved by
// two ranks, a flipped byte reported with exit 1 naming the file and key, conversions to
// safetensors and back compared by diff, and bad input answered with one line and exit 2.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <regex>

#include "command_testing.h"
#include "dcp_testing.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "multi_rank.h"

namespace ckpt = fsdp::checkpoint;
using fsdp::ShardedTensor;
using fsdp::ShardMetadata;
using fsdp::StateDict;
using fsdp::dist::ProcessGroup;
using fsdp::testing::run_ranks;
using fsdp::testing::TempDir;

namespace {

using ToolRun = fsdp::testing::CommandResult;

ToolRun tool(const std::string& args) {
  return fsdp::testing::run_shell(std::string(FSDP_CKPT_BIN) + " " + args);
}

bool has(const ToolRun& r, const std::string& part) {
  return r.out.find(part) != std::string::npos;
}

StateDict sample(int rank, double scale) {
  const at::Tensor full = at::arange(24, at::kFloat).reshape({4, 6}) * scale;
  StateDict model;
  model.insert_or_assign("w", ShardedTensor({4, 6}, at::kFloat,
                                            {{full.narrow(0, 2 * rank, 2).clone(),
                                              ShardMetadata{{2 * rank, 0}, {2, 6}, rank}}}));
  model.insert_or_assign("b", at::ones({6}) * scale);
  StateDict sd;
  sd.insert_or_assign("model", model);
  sd.insert_or_assign("epoch", int64_t{3});
  return sd;
}

TEST(FsdpCkptTool, InspectVerifyConvertDiff) {
  TempDir tmp;
  const std::string c = tmp.file("c"), c2 = tmp.file("c2");
  run_ranks(2, [&](ProcessGroup& pg) {
    ckpt::save(sample(pg.rank(), 1.0), c,
               ckpt::SaveOptions().annotations({{"sharding_strategy", "FULL_SHARD"}}));
    ckpt::save(sample(pg.rank(), 2.0), c2);
  });
  ToolRun r = tool("inspect " + c);
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(has(r, "saved by 2 rank(s)")) << r.out;
  EXPECT_TRUE(has(r, "sharding_strategy: FULL_SHARD")) << r.out;
  EXPECT_TRUE(has(r, "model.w  float32 [4, 6]  2 chunk(s)")) << r.out;
  EXPECT_TRUE(has(r, "epoch  value")) << r.out;
  r = tool("verify " + c);
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(has(r, "ok: ")) << r.out;

  // Export and compare: equal to the checkpoint's model, different from another step.
  r = tool("convert " + c + " " + tmp.file("st") + " --to safetensors --max-shard-bytes 64");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(has(r, "model.safetensors.index.json")) << r.out;
  r = tool("diff " + c + " " + tmp.file("st") + " --strip-a model.");
  EXPECT_EQ(r.rc, 0) << r.out;
  r = tool("convert " + c + " " + tmp.file("m.pt") + " --to pt");
  EXPECT_EQ(r.rc, 0) << r.out;
  r = tool("convert " + tmp.file("m.pt") + " " + tmp.file("back") + " --to dcp");
  EXPECT_EQ(r.rc, 0) << r.out;
  r = tool("diff " + c + " " + tmp.file("back"));
  EXPECT_EQ(r.rc, 0) << r.out;
  r = tool("diff " + c + " " + c2);
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_TRUE(has(r, "model.w: 23 of 24 elements differ")) << r.out;
  // A plain model state dict (dcp.save(get_model_state_dict(model))) converts without --prefix,
  // under its own keys; with --prefix model. it fails, naming the prefix.
  const std::string plain = tmp.file("plain");
  run_ranks(1, [&](ProcessGroup&) {
    StateDict sd;
    sd.insert_or_assign("w", at::arange(6, at::kFloat));
    ckpt::save(sd, plain);
  });
  r = tool("convert " + plain + " " + tmp.file("plain.pt") + " --to pt");
  EXPECT_EQ(r.rc, 0) << r.out;
  r = tool("diff " + plain + " " + tmp.file("plain.pt"));
  EXPECT_EQ(r.rc, 0) << r.out;
  r = tool("convert " + plain + " " + tmp.file("plain2.pt") + " --to pt --prefix model.");
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_TRUE(has(r, "no tensor under the prefix 'model.'")) << r.out;
  r = tool("diff " + c + " " + c2 + " --rtol 0.6");
  EXPECT_EQ(r.rc, 0) << r.out;

  // One flipped byte in rank 1's file: exit 1 naming the file and the key.
  const std::string data = c + "/__1_0.distcp";
  std::string bytes;
  {
    std::ifstream f(data, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  bytes[bytes.size() / 2] ^= 0x04;
  std::ofstream(data, std::ios::binary | std::ios::trunc) << bytes;
  r = tool("verify " + c);
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_TRUE(has(r, "__1_0.distcp") && has(r, "'model.w'") && has(r, "checksum mismatch"))
      << r.out;
  r = tool("diff " + c + " " + tmp.file("st") + " --strip-a model.");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_TRUE(has(r, "checksum mismatch")) << r.out;

  // Bad input: one line, exit 2.
  r = tool("inspect " + tmp.file("missing"));
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  EXPECT_TRUE(has(r, "does not exist")) << r.out;
  std::ofstream(c2 + "/.metadata", std::ios::binary | std::ios::trunc) << "garbage";
  r = tool("verify " + c2);
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_TRUE(has(r, ".metadata")) << r.out;
  r = tool("convert " + c + " " + tmp.file("x") + " --to zip");
  EXPECT_EQ(r.rc, 2) << r.out;
  r = tool("");
  EXPECT_EQ(r.rc, 2) << r.out;
  for (const std::string sub : {"", "inspect ", "verify ", "convert ", "diff "}) {
    r = tool(sub + "--help");
    EXPECT_EQ(r.rc, 0) << sub << r.out;
    EXPECT_TRUE(has(r, "[OPTIONS]")) << r.out;  // CLI11 2.1 says "Usage: ...", 2.4 does not
  }
}

// The manifest is not checksummed: a created_unix that gmtime cannot represent (2^63 - 1) sent
// strftime a null tm and crashed inspect (issue 39). It is printed as the number it is.
TEST(FsdpCkptTool, InspectPrintsAnUnrepresentableSaveTime) {
  TempDir tmp;
  const std::string c = tmp.file("c");
  run_ranks(2, [&](ProcessGroup& pg) { ckpt::save(sample(pg.rank(), 1.0), c); });
  const std::string path = c + "/.fsdp_manifest.json";
  const std::string mf = fsdp::testing::read_bytes(path);
  const std::string edited = std::regex_replace(mf, std::regex("\"created_unix\": *[0-9]+"),
                                                "\"created_unix\": 9223372036854775807");
  ASSERT_NE(edited, mf);
  fsdp::testing::write_bytes(path, edited);
  const ToolRun r = tool("inspect " + c);
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(has(r, "at created_unix 9223372036854775807 (not a representable time)")) << r.out;
  EXPECT_TRUE(has(r, "saved by 2 rank(s)")) << r.out;
}

}  // namespace
