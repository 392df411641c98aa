// fsdp-ckpt: look into, check, convert and compare checkpoints (issue 11).
//
//   fsdp-ckpt inspect DIR                 keys, dtypes, shapes, bytes, who saved it
//   fsdp-ckpt verify DIR                  every checksum, chunk coverage, every item decodes
//   fsdp-ckpt convert SRC DST --to FMT    checkpoint -> safetensors | pt, and files -> dcp
//   fsdp-ckpt diff A B [--rtol --atol]    two checkpoints or exports, tensor by tensor
//   fsdp-ckpt assemble OUT DIR...         a node-local save's per-host directories -> one
//
// Exit status: 0 fine, 1 verification or diff found a difference, 2 bad usage or an error. Every
// error is one line on stderr; nothing here may crash or die on a signal.
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "ckpt_commands.h"
#include "fsdp/checkpoint/file_io.h"

namespace {

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp-ckpt: inspect, verify, convert and compare fsdp-cpp / PyTorch DCP checkpoints"};
  app.require_subcommand(1);
  std::string dir, src, dst, to = "safetensors", prefix, a, b, strip_a, strip_b;
  int64_t max_shard = 0;
  double rtol = 0, atol = 0;
  auto* inspect = app.add_subcommand("inspect",
                                     "List a checkpoint's keys, dtypes, shapes and sizes, "
                                     "and who saved it");
  inspect->add_option("dir", dir, "checkpoint directory")->required();
  auto* verify = app.add_subcommand(
      "verify",
      "Check every byte against the manifest's checksums, chunk coverage and decoding; "
      "exit 1 naming the file and key on failure");
  verify->add_option("dir", dir, "checkpoint directory")->required();
  auto* convert = app.add_subcommand(
      "convert",
      "Checkpoint to safetensors (a directory) or .pt; safetensors or .pt to a checkpoint");
  convert->add_option("src", src, "checkpoint directory, safetensors file/directory or .pt file")
      ->required();
  convert->add_option("dst", dst, "output directory (safetensors, dcp) or file (pt)")->required();
  convert->add_option("--to", to, "safetensors, pt or dcp")
      ->check(CLI::IsMember({"safetensors", "pt", "dcp"}))
      ->capture_default_str();
  auto* prefix_opt = convert->add_option(
      "--prefix", prefix,
      "checkpoint keys to export (stripped from the names; default: 'model.' for a {model, optim} "
      "checkpoint, every tensor of any other), or the key to put imported tensors under "
      "(default: model.)");
  convert->add_option("--max-shard-bytes", max_shard,
                      "safetensors: split into files of at most this many bytes (0: one file)");
  auto* diff = app.add_subcommand("diff",
                                  "Compare the tensors of two checkpoints or exports; exit 1 "
                                  "if they differ");
  diff->add_option("a", a, "checkpoint directory, safetensors or .pt")->required();
  diff->add_option("b", b, "checkpoint directory, safetensors or .pt")->required();
  diff->add_option("--rtol", rtol, "relative tolerance")->capture_default_str();
  diff->add_option("--atol", atol, "absolute tolerance")->capture_default_str();
  diff->add_option("--strip-a", strip_a, "drop this prefix from A's keys (e.g. model.)");
  diff->add_option("--strip-b", strip_b, "drop this prefix from B's keys");
  std::vector<std::string> host_dirs;
  auto* assemble = app.add_subcommand(
      "assemble",
      "Gather the per-host directories of a node-local save (--node-local) into one ordinary "
      "checkpoint directory, verified, that stock dcp.load reads");
  assemble->add_option("out", dst, "the checkpoint directory to create")->required();
  assemble->add_option("dirs", host_dirs, "each host's directory of the checkpoint")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  // The commands themselves are in tools/ckpt_commands.cpp, where the fuzz target runs them too.
  auto& io = fsdp::checkpoint::default_file_io();
  const fsdp_ckpt::Output out{std::cout, std::cerr, ::isatty(2) == 1};
  try {
    if (*inspect) return fsdp_ckpt::inspect(dir, io, out);
    if (*verify) return fsdp_ckpt::verify(dir, io, out);
    if (*convert) {
      const std::optional<std::string> given =
          prefix_opt->count() > 0 ? std::optional<std::string>(prefix) : std::nullopt;
      return fsdp_ckpt::convert(src, dst, to, given, max_shard, io, out);
    }
    if (*diff) return fsdp_ckpt::diff(a, b, rtol, atol, strip_a, strip_b, io, out);
    if (*assemble) return fsdp_ckpt::assemble(dst, host_dirs, io, out);
  } catch (const std::exception& e) {
    std::cerr << "fsdp-ckpt: " << first_line(e.what()) << "\n";
    return 2;
  } catch (...) {
    std::cerr << "fsdp-ckpt: unknown error\n";
    return 2;
  }
  return 2;
}
