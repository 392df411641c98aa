// Shared by the benchmark programs, without LibTorch (bench_fresh_memory has none): settings
// from the environment and the median that every figure is.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp_bench {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Integer from the environment, or `fallback`.
inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

/// Number from the environment, or `fallback`.
inline double env_double(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atof(v) : fallback;
}

/// String from the environment, or `fallback`.
inline std::string env_str(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

/// Comma-separated integers from the environment, or `fallback`.
inline std::vector<int64_t> env_list(const char* name, std::vector<int64_t> fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  std::vector<int64_t> out;
  std::stringstream ss(v);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(std::atoll(item.c_str()));
  return out;
}

}  // namespace fsdp_bench
