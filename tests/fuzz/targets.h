// The fuzz targets: each feeds one input to one of fsdp-cpp's readers of untrusted bytes.
//
// A target returns normally for every input, well-formed or not: a reader that refuses its input
// throws an fsdp::Error (ValueError, CorruptionError, PickleError, ...), which the target catches
// (FSDP_FUZZ_VERBOSE=1 prints it).
// Anything else is a finding: a crash or a sanitizer report, an exception of another type, a
// round trip that does not reproduce what was read (the target aborts), or, under libFuzzer, an
// input that takes over a second or allocates beyond the stated bound (scripts/fuzz.sh).
//
// The same functions run in two places: the libFuzzer binaries of an FSDP_FUZZ=ON build
// (tests/fuzz/fuzz_main.cpp, one per target), and test_fuzz_replay in the normal suite, which
// replays every seed and every kept regression input (tests/fuzz/corpus/<target>/,
// tests/fuzz/regressions/<target>/) through them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace fuzz {

/// True if the reader accepted the input all the way through, false if it refused it (an
/// fsdp::Error, as it should for anything malformed). Seeds made from real files must be
/// accepted: otherwise the fuzzer would start from an error path (test_fuzz_replay checks).
using TargetFn = bool (*)(const uint8_t* data, size_t size);

struct Target {
  const char* name;
  /// What it reads, for --help and the docs.
  const char* reads;
  TargetFn run;
};

/// Every target, in a fixed order.
const std::vector<Target>& targets();

/// The target called `name`, or null.
const Target* find_target(const std::string& name);

/// The framing of inputs that hold several files, parts separated by this marker. The
/// `checkpoint` target's parts are the files `.metadata`, `__0_0.distcp` and
/// `.fsdp_manifest.json`, in that order (a missing part is a missing file). The targets of
/// dir_targets.h take named files instead: each part is "<relative path>\n<bytes>", so that an
/// input may hold any number of files in any directories. tests/fuzz/make_seeds.py packs real
/// checkpoints and exports into both.
inline constexpr const char* kFileSeparator = "\n#FSDP-FUZZ-FILE#\n";

}  // namespace fuzz
}  // namespace fsdp
