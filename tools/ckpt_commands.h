// fsdp-ckpt's commands, apart from its command line (tools/fsdp_ckpt.cpp): each takes the FileIO
// to read and write through and the streams to print on, so that the fuzz target `fsdp_ckpt`
// (tests/fuzz/targets.cpp) runs the tool's own code on hostile files held in memory.
//
// Every command returns the tool's exit status (0 fine, 1 a verification or diff found a
// difference) and throws what the library throws (fsdp::Error) for anything it cannot read.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "fsdp/checkpoint/file_io.h"
#include "fsdp/state_value.h"

namespace fsdp_ckpt {

using fsdp::checkpoint::FileIO;

/// Where a command prints: `out` its report, `err` the problems (verify's), `progress` a bar on a
/// terminal's stderr (verify of a large checkpoint).
struct Output {
  std::ostream& out;
  std::ostream& err;
  bool progress = false;
};

/// Keys, dtypes, shapes and sizes of the checkpoint in `dir`, and who saved it.
int inspect(const std::string& dir, FileIO& io, const Output& o);
/// Every checksum, chunk coverage and item; 1 (problems on `err`) when anything is wrong.
int verify(const std::string& dir, FileIO& io, const Output& o);
/// A checkpoint to safetensors (`to` "safetensors", a directory) or `.pt` ("pt"), or a
/// safetensors/.pt export back into a checkpoint ("dcp"), the tensors under `prefix` (default
/// "model."). For the exports, `prefix` unset takes the checkpoint's layout.
int convert(const std::string& src, const std::string& dst, const std::string& to,
            const std::optional<std::string>& prefix, int64_t max_shard_bytes, FileIO& io,
            const Output& o);
/// The tensors of two checkpoints or exports, key by key, within `rtol`/`atol`; 1 if any differ.
/// `strip_a`/`strip_b` drop a prefix from the keys of each (e.g. "model.").
int diff(const std::string& a, const std::string& b, double rtol, double atol,
         const std::string& strip_a, const std::string& strip_b, FileIO& io, const Output& o);
/// A node-local save's per-host directories gathered into `out_dir`, verified.
int assemble(const std::string& out_dir, const std::vector<std::string>& dirs, FileIO& io,
             const Output& o);

/// The tensors of a checkpoint directory, a safetensors file, index or directory, or a `.pt`
/// file, as one flat dict (a checkpoint keeps its DCP keys; non-tensor values are left out).
fsdp::StateDict tensors_of(const std::string& path, FileIO& io);

}  // namespace fsdp_ckpt
