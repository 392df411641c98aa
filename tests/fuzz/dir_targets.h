// The fuzz targets that read several files at once (tests/fuzz/dir_targets.cpp), and what they
// share with the one-file targets of targets.cpp. Internal to tests/fuzz/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fsdp/errors.h"
#include "mem_fs.h"

namespace fsdp {
namespace fuzz {

/// A reader refused the input, as it should refuse anything malformed: returns false. With
/// FSDP_FUZZ_VERBOSE set, says why (to see where a seed or a finding stops).
bool refused(const Error& e);

/// A broken invariant that no input may break (a round trip that changes what was read, two
/// readers that disagree): aborts, which both libFuzzer and the replay test report as a finding.
[[noreturn]] void finding(const char* target, const std::string& what);

/// Lowers the load's direct read of an item into its target (normally from 256 KiB, which no fuzz
/// input reaches) to 0, once per process: both ways of reading an item then see hostile bytes.
void direct_reads_from_zero();

/// Verifies the checkpoint in `dir`: true if it passes, or if its one problem is a missing
/// manifest (Python's checkpoints have none). A verify that throws is a refusal: false.
bool verified_checkpoint(const std::string& dir, MemFS& fs);

/// Puts the files of a named-files input (targets.h, kFileSeparator: "<path>\n<bytes>" parts)
/// into `fs` under `root` (which ends in '/'). A part whose path is empty, absolute, longer than
/// 200 bytes, or holds an empty, "." or ".." component or a control character is skipped; so is
/// every part past the 64th. Returns the number of files added.
int add_named_files(MemFS& fs, const std::string& root, const uint8_t* data, size_t size);

/// Several data files, a manifest and `.metadata` under /fuzz/ckpt: verify, inspect, a full load,
/// and a load into pieces (as a sharded model's template) that must agree with the full one.
bool run_checkpoint_files(const uint8_t* data, size_t size);
/// A safetensors directory (one file, or shards with `model.safetensors.index.json`): load, then
/// write and read back, which must give the same tensors.
bool run_safetensors_files(const uint8_t* data, size_t size);
/// The per-host directories of a node-local save, assembled into one checkpoint (fsdp-ckpt
/// assemble), which must then load.
bool run_assemble(const uint8_t* data, size_t size);
/// fsdp-ckpt's own commands on a checkpoint or export: inspect, verify, diff against itself (no
/// difference), convert to safetensors and `.pt` (which must agree) and back to a checkpoint.
bool run_fsdp_ckpt(const uint8_t* data, size_t size);

}  // namespace fuzz
}  // namespace fsdp
