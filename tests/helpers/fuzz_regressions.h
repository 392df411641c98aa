// The hostile-file tables of the checkpoint tests as fuzz regression inputs (issue 62): with
// FSDP_FUZZ_REGRESSIONS_OUT=DIR set, each table case also writes its file(s) to
// DIR/<fuzz target>/<case name>, in the target's framing (tests/fuzz/targets.h), so that every
// family of hostile file those tests reject is kept in tests/fuzz/regressions/ and replayed
// through the fuzz targets (test_fuzz_replay), and a campaign starts from it. Unset (always in
// the suite), nothing is written.
//
//   FSDP_FUZZ_REGRESSIONS_OUT=/tmp/reg build/tests/test_checkpoint_safety
//   cp -r /tmp/reg/* tests/fuzz/regressions/
#pragma once

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

namespace fsdp {
namespace testing {

/// Writes `bytes` as the regression input `name` of fuzz target `target`, if
/// FSDP_FUZZ_REGRESSIONS_OUT is set. The name becomes a file name: letters, digits and '-' kept,
/// anything else '-'. Inputs over 1 MiB are not kept: scripts/fuzz.sh's -max_len, so libFuzzer
/// would cut them short as seeds; and the two such cases today (lists nested a million deep, 2 MB
/// each) take 8-15 s each under ASan, near test_fuzz_replay's 20 s per input. Their tables still
/// build and test them.
inline void keep_as_fuzz_regression(const std::string& target, const std::string& name,
                                    const std::string& bytes) {
  const char* out = std::getenv("FSDP_FUZZ_REGRESSIONS_OUT");
  if (out == nullptr || bytes.size() > (size_t{1} << 20)) return;
  std::string file;
  for (const char c : name) file += std::isalnum(static_cast<unsigned char>(c)) ? c : '-';
  const std::filesystem::path dir = std::filesystem::path(out) / target;
  std::filesystem::create_directories(dir);
  std::ofstream(dir / file, std::ios::binary) << bytes;
}

/// Every regular file under `dir` in the named-files framing of the directory targets: parts
/// "<prefix><relative path>\n<bytes>", in path order, joined by `separator`.
inline std::string pack_named_files(const std::string& dir, const std::string& prefix,
                                    const std::string& separator) {
  std::map<std::string, std::string> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    files[prefix + std::filesystem::relative(e.path(), dir).string()] =
        std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::string out;
  for (const auto& [path, bytes] : files) {
    if (!out.empty()) out += separator;
    out += path + "\n" + bytes;
  }
  return out;
}

}  // namespace testing
}  // namespace fsdp
