// Internal: the one way fsdp-cpp builds the text of an error (fsdp/errors.h says which type to
// throw; this says how its message reads).
//
// A message reads "<where>: <what is wrong>" and names what it is about, always spelt the same:
//
//   quote(key)    'model.0.weight'   a state-dict key, parameter name, field or option value
//   rank(r)       rank 3             the rank a fact is about (this one, or a peer)
//   shape(s)      [2, 3]             a size, as PyTorch prints one ("[]" for a 0-d tensor)
//   a path        /ckpt/step-10      a file or directory, as given (paths are not quoted)
//
// msg(parts...) concatenates strings, integers (std::to_string's digits, no locale), the markers
// above, dtypes and anything else with an operator<< (devices). So instead of
//     throw ValueError("load: '" + key + "' has shape " + shape_str(s) + " on rank " + ...);
// write
//     throw ValueError(msg("load: ", quote(key), " has shape ", shape(s), " on ", rank(r)));
// (a throw statement, not a [[noreturn]] helper: the reader and the compiler see control leave).
// Floating-point values print in the stream's default format; pass std::to_string(x) where six
// fixed decimals are wanted.
// Tests compare many messages word for word: the markers print exactly what the hand-made
// concatenations printed, so moving a message onto them changes no text.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp {
namespace detail {

struct Quoted {
  std::string_view text;
};
struct RankRef {
  int64_t rank;
};
struct Shape {
  std::vector<int64_t> dims;
};

/// 'text': a key, a parameter name, a field. (Not `quoted`: with a std::string argument,
/// argument-dependent lookup would pick std::quoted, which prints "text".)
inline Quoted quote(std::string_view text) { return Quoted{text}; }
/// "rank 3".
inline RankRef rank(int64_t r) { return RankRef{r}; }
/// "[2, 3]" ("[]" for a 0-d shape).
inline Shape shape(at::IntArrayRef s) { return Shape{s.vec()}; }

namespace message_parts {

inline void append(std::string& out, std::string_view s) { out.append(s.data(), s.size()); }
inline void append(std::string& out, const char* s) { out.append(s); }
inline void append(std::string& out, const std::string& s) { out.append(s); }
inline void append(std::string& out, char c) { out.push_back(c); }
inline void append(std::string& out, const Quoted& q) {
  out.push_back('\'');
  out.append(q.text.data(), q.text.size());
  out.push_back('\'');
}
inline void append(std::string& out, const RankRef& r) {
  out.append("rank ");
  out.append(std::to_string(r.rank));
}
inline void append(std::string& out, const Shape& s) {
  out.push_back('[');
  for (size_t i = 0; i < s.dims.size(); ++i) {
    if (i) out.append(", ");
    out.append(std::to_string(s.dims[i]));
  }
  out.push_back(']');
}
inline void append(std::string& out, at::ScalarType t) { out.append(c10::toString(t)); }
template <typename T>
std::enable_if_t<std::is_integral<T>::value && !std::is_same<T, bool>::value &&
                 !std::is_same<T, char>::value>
append(std::string& out, T v) {
  out.append(std::to_string(v));
}
// Anything else that streams (devices, doubles in the stream's default format).
template <typename T>
std::enable_if_t<!std::is_integral<T>::value &&
                 !std::is_convertible<const T&, std::string_view>::value>
append(std::string& out, const T& v) {
  std::ostringstream s;
  s << v;
  out.append(s.str());
}

}  // namespace message_parts

/// The parts, concatenated (see the file's comment).
template <typename... Parts>
std::string msg(const Parts&... parts) {
  std::string out;
  (message_parts::append(out, parts), ...);
  return out;
}

}  // namespace detail
}  // namespace fsdp
