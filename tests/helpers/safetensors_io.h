// A small, strict safetensors reader and writer for tests (header-only), plus the minimal JSON it
// needs. Used by tests/oracle/oracle_fsdp.cpp to exchange weights, batches and results with Python
// (safetensors.torch) without running anything from the files.
//
// Format (https://github.com/huggingface/safetensors): 8 bytes little-endian u64 N, then N bytes
// of JSON header {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...,
// "__metadata__": {"k": "v"}}, then the data buffer. Offsets are relative to the buffer start.
//
// The reader validates what the reference implementation validates: header size (<= 100 MB and
// inside the file), well-formed JSON with nothing after it, known dtypes, non-negative shapes,
// offsets that match numel * itemsize, tensors that are contiguous, non-overlapping and cover
// the buffer exactly, string-only metadata. Any violation throws std::runtime_error naming the
// file and the problem.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
namespace testing {
namespace json {

/// A parsed JSON value. Numbers keep their text; integers are also available as int64.
struct Value {
  enum class Kind { NONE, BOOL, NUMBER, STRING, ARRAY, OBJECT };  // NONE: JSON's null
  Kind kind = Kind::NONE;
  bool boolean = false;
  std::string text;  // String: the decoded string; Number: the literal
  std::vector<Value> array;
  std::vector<std::pair<std::string, Value>> object;  // in document order

  bool is_integer() const {
    return kind == Kind::NUMBER && text.find_first_of(".eE") == std::string::npos;
  }
  int64_t as_int(const std::string& what) const {
    if (!is_integer()) throw std::runtime_error(what + ": expected an integer");
    size_t pos = 0;
    long long v = 0;
    try {
      v = std::stoll(text, &pos);
    } catch (const std::exception&) {
      throw std::runtime_error(what + ": integer out of range: " + text);
    }
    if (pos != text.size()) throw std::runtime_error(what + ": bad integer " + text);
    return static_cast<int64_t>(v);
  }
  const std::string& as_string(const std::string& what) const {
    if (kind != Kind::STRING) throw std::runtime_error(what + ": expected a string");
    return text;
  }
  const Value* find(const std::string& key) const {
    for (const auto& kv : object)
      if (kv.first == key) return &kv.second;
    return nullptr;
  }
};

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}
  Value parse_document() {
    Value v = parse_value(0);
    skip_ws();
    if (i_ != s_.size()) fail("trailing characters after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& msg) const {
    throw std::runtime_error("JSON: " + msg + " at byte " + std::to_string(i_));
  }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
      ++i_;
  }
  char peek() {
    skip_ws();
    if (i_ >= s_.size()) fail("unexpected end");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }
  Value parse_value(int depth) {
    if (depth > 64) fail("nesting too deep");
    const char c = peek();
    Value v;
    if (c == '{') {
      v.kind = Value::Kind::OBJECT;
      ++i_;
      if (peek() == '}') {
        ++i_;
        return v;
      }
      for (;;) {
        if (peek() != '"') fail("expected a string key");
        std::string key = parse_string();
        for (const auto& kv : v.object)
          if (kv.first == key) fail("duplicate key '" + key + "'");
        expect(':');
        v.object.emplace_back(std::move(key), parse_value(depth + 1));
        const char d = peek();
        ++i_;
        if (d == '}') break;
        if (d != ',') fail("expected ',' or '}'");
      }
    } else if (c == '[') {
      v.kind = Value::Kind::ARRAY;
      ++i_;
      if (peek() == ']') {
        ++i_;
        return v;
      }
      for (;;) {
        v.array.push_back(parse_value(depth + 1));
        const char d = peek();
        ++i_;
        if (d == ']') break;
        if (d != ',') fail("expected ',' or ']'");
      }
    } else if (c == '"') {
      v.kind = Value::Kind::STRING;
      v.text = parse_string();
    } else if (c == 't' || c == 'f' || c == 'n') {
      for (const char* lit : {"true", "false", "null"}) {
        const size_t n = std::strlen(lit);
        if (s_.compare(i_, n, lit) == 0) {
          i_ += n;
          v.kind = lit[0] == 'n' ? Value::Kind::NONE : Value::Kind::BOOL;
          v.boolean = lit[0] == 't';
          return v;
        }
      }
      fail("bad literal");
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = Value::Kind::NUMBER;
      const size_t start = i_;
      if (s_[i_] == '-') ++i_;
      auto digits = [&] {
        const size_t d0 = i_;
        while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
        if (i_ == d0) fail("bad number");
      };
      digits();
      if (i_ < s_.size() && s_[i_] == '.') {
        ++i_;
        digits();
      }
      if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
        ++i_;
        if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
        digits();
      }
      v.text = s_.substr(start, i_ - start);
    } else {
      fail(std::string("unexpected character '") + c + "'");
    }
    return v;
  }
  static void put_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  uint32_t hex4() {
    if (i_ + 4 > s_.size()) fail("short \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[i_++];
      v <<= 4;
      if (h >= '0' && h <= '9')
        v |= h - '0';
      else if (h >= 'a' && h <= 'f')
        v |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F')
        v |= h - 'A' + 10;
      else
        fail("bad \\u escape");
    }
    return v;
  }
  std::string parse_string() {
    expect('"');
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) fail("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      const char e = s_[i_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (i_ + 2 > s_.size() || s_[i_] != '\\' || s_[i_ + 1] != 'u') fail("lone surrogate");
            i_ += 2;
            const uint32_t lo = hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail("bad surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            fail("lone surrogate");
          }
          put_utf8(out, cp);
          break;
        }
        default:
          fail("bad escape");
      }
    }
  }
  const std::string& s_;
  size_t i_ = 0;
};

inline Value parse(const std::string& s) { return Parser(s).parse_document(); }

/// `s` as a JSON string literal.
inline std::string quote(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

template <typename T>
std::string int_list(const std::vector<T>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

}  // namespace json

namespace safetensors {

/// dtype name <-> ScalarType. Only the types tests use; others are rejected by name.
inline at::ScalarType dtype_from_name(const std::string& n, const std::string& what) {
  static const std::map<std::string, at::ScalarType> m = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  auto it = m.find(n);
  if (it == m.end()) throw std::runtime_error(what + ": unsupported dtype '" + n + "'");
  return it->second;
}
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return "F64";
    case at::kFloat:
      return "F32";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    case at::kLong:
      return "I64";
    case at::kInt:
      return "I32";
    case at::kShort:
      return "I16";
    case at::kChar:
      return "I8";
    case at::kByte:
      return "U8";
    case at::kBool:
      return "BOOL";
    default:
      throw std::runtime_error(std::string("safetensors: unsupported dtype ") + c10::toString(t));
  }
}

struct File {
  /// Tensors in header order (the Python writer sorts them; do not rely on the order).
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::vector<std::pair<std::string, std::string>> metadata;

  const at::Tensor& at(const std::string& name) const {
    for (const auto& kv : tensors)
      if (kv.first == name) return kv.second;
    throw std::runtime_error("safetensors: no tensor '" + name + "'");
  }
  bool has(const std::string& name) const {
    for (const auto& kv : tensors)
      if (kv.first == name) return true;
    return false;
  }
  const std::string& meta(const std::string& key) const {
    for (const auto& kv : metadata)
      if (kv.first == key) return kv.second;
    throw std::runtime_error("safetensors: no metadata '" + key + "'");
  }
};

static_assert(sizeof(uint64_t) == 8, "u64");

inline bool host_is_little_endian() {
  const uint16_t x = 1;
  unsigned char b;
  std::memcpy(&b, &x, 1);
  return b == 1;
}

/// Reads and validates a whole safetensors file; tensors are CPU tensors owning their data.
inline File read(const std::string& path) {
  auto fail = [&](const std::string& m) -> std::runtime_error {
    return std::runtime_error("safetensors: " + path + ": " + m);
  };
  if (!host_is_little_endian()) throw fail("big-endian hosts are not supported");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw fail("cannot open");
  in.seekg(0, std::ios::end);
  const auto file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  if (file_size < 8) throw fail("shorter than the 8-byte header length");
  unsigned char lenbuf[8];
  in.read(reinterpret_cast<char*>(lenbuf), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | lenbuf[i];
  if (n > 100u * 1000 * 1000) throw fail("header larger than 100 MB");
  if (n > file_size - 8) throw fail("header length beyond the end of the file");
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  if (!in) throw fail("cannot read the header");
  const uint64_t data_size = file_size - 8 - n;
  std::vector<char> data(data_size);
  if (data_size) in.read(data.data(), static_cast<std::streamsize>(data_size));
  if (!in) throw fail("cannot read the data");

  json::Value root;
  try {
    root = json::parse(header);
  } catch (const std::exception& e) {
    throw fail(std::string("bad header: ") + e.what());
  }
  if (root.kind != json::Value::Kind::OBJECT) throw fail("header is not a JSON object");
  File f;
  struct Span {
    uint64_t b, e;
    std::string name;
  };
  std::vector<Span> spans;
  for (const auto& [name, v] : root.object) {
    const std::string what = "safetensors: " + path + ": '" + name + "'";
    if (name == "__metadata__") {
      if (v.kind != json::Value::Kind::OBJECT) throw fail("__metadata__ is not an object");
      for (const auto& [mk, mv] : v.object)
        f.metadata.emplace_back(mk, mv.as_string(what + " metadata " + mk));
      continue;
    }
    if (v.kind != json::Value::Kind::OBJECT) throw fail("entry '" + name + "' is not an object");
    const json::Value* dt = v.find("dtype");
    const json::Value* sh = v.find("shape");
    const json::Value* off = v.find("data_offsets");
    if (!dt || !sh || !off || v.object.size() != 3)
      throw fail("entry '" + name + "' needs exactly dtype, shape and data_offsets");
    const at::ScalarType dtype = dtype_from_name(dt->as_string(what), what);
    if (sh->kind != json::Value::Kind::ARRAY) throw fail("shape of '" + name + "' is not a list");
    std::vector<int64_t> shape;
    uint64_t numel = 1;
    for (const auto& d : sh->array) {
      const int64_t x = d.as_int(what + " shape");
      if (x < 0) throw fail("negative dimension in '" + name + "'");
      shape.push_back(x);
      if (x != 0 && numel > UINT64_MAX / static_cast<uint64_t>(x))
        throw fail("shape of '" + name + "' overflows");
      numel *= static_cast<uint64_t>(x);
    }
    if (off->kind != json::Value::Kind::ARRAY || off->array.size() != 2)
      throw fail("data_offsets of '" + name + "' is not [begin, end]");
    const int64_t b = off->array[0].as_int(what + " data_offsets");
    const int64_t e = off->array[1].as_int(what + " data_offsets");
    if (b < 0 || e < b || static_cast<uint64_t>(e) > data_size)
      throw fail("data_offsets of '" + name + "' outside the data buffer");
    const uint64_t item = c10::elementSize(dtype);
    if (numel > UINT64_MAX / item || static_cast<uint64_t>(e - b) != numel * item)
      throw fail("data_offsets of '" + name + "' do not match its dtype and shape");
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
    if (e > b) std::memcpy(t.data_ptr(), data.data() + b, static_cast<size_t>(e - b));
    f.tensors.emplace_back(name, t);
    spans.push_back({static_cast<uint64_t>(b), static_cast<uint64_t>(e), name});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& x, const Span& y) { return x.b != y.b ? x.b < y.b : x.e < y.e; });
  uint64_t at_byte = 0;
  for (const auto& s : spans) {
    if (s.b != at_byte)
      throw fail("tensor '" + s.name + "' " +
                 (s.b < at_byte ? "overlaps the previous one" : "leaves a gap before it"));
    at_byte = s.e;
  }
  if (at_byte != data_size) throw fail("tensors do not cover the data buffer");
  return f;
}

/// Writes `tensors` (any layout; written contiguous, in the given order) and string metadata.
inline void write(const std::string& path,
                  const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                  const std::vector<std::pair<std::string, std::string>>& metadata = {}) {
  if (!host_is_little_endian()) throw std::runtime_error("safetensors: big-endian host");
  std::string header = "{";
  bool first = true;
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i)
      header +=
          (i ? "," : "") + json::quote(metadata[i].first) + ":" + json::quote(metadata[i].second);
    header += "}";
    first = false;
  }
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, t0] : tensors) {
    if (name == "__metadata__") throw std::runtime_error("safetensors: reserved name");
    at::Tensor t = t0.detach().to(at::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    header += std::string(first ? "" : ",") + json::quote(name) + ":{\"dtype\":\"" +
              dtype_name(t.scalar_type()) + "\",\"shape\":" + json::int_list(t.sizes().vec()) +
              ",\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + bytes) + "]}";
    first = false;
    offset += bytes;
    data.push_back(t);
  }
  header += "}";
  while (header.size() % 8) header += ' ';  // as the reference writer: data 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("safetensors: cannot create " + path);
  uint64_t n = header.size();
  unsigned char lenbuf[8];
  for (int i = 0; i < 8; ++i) lenbuf[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xFF);
  out.write(reinterpret_cast<const char*>(lenbuf), 8);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const auto& t : data)
    if (t.numel())
      out.write(static_cast<const char*>(t.data_ptr()),
                static_cast<std::streamsize>(t.numel() * t.element_size()));
  out.close();
  if (!out) throw std::runtime_error("safetensors: writing " + path + " failed");
}

}  // namespace safetensors
}  // namespace testing
}  // namespace fsdp
