// Python as the outside reference in tests: the interpreter CMake found with torch >= 2 and
// torch.distributed.checkpoint (FSDP_TEST_PYTHON; the trixie chroot has one, Debian 12's 1.13
// does not), the helper script tests/dcp/dcp_python.py, and running a command for its output.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace fsdp {
namespace testing {

/// The Python to use, or "" (tests then GTEST_SKIP).
inline std::string python() {
#ifdef FSDP_TEST_PYTHON
  return FSDP_TEST_PYTHON;
#else
  return "";
#endif
}

/// `python -W ignore tests/dcp/dcp_python.py ` (append the command and its arguments).
inline std::string dcp_python() {
  return python() + " -W ignore " + std::string(FSDP_TEST_SOURCE_DIR) + "/dcp/dcp_python.py ";
}

/// The command's standard output; a non-zero exit is a test failure.
inline std::string run_command(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>/dev/null").c_str(), "r");
  if (!p) {
    ADD_FAILURE() << "popen failed: " << cmd;
    return "";
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  if (rc != 0) ADD_FAILURE() << cmd << " exited with " << rc;
  return out;
}

}  // namespace testing
}  // namespace fsdp
