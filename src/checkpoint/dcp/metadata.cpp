// DCP `.metadata` <-> C++ (see metadata.h). Reading checks every value's kind and range;
// writing emits the classes under their 2.3+ module paths, which 2.6 and 2.14 load.
#include "checkpoint/dcp/metadata.h"

#include <set>

#include "checkpoint/formats/pickle.h"
#include "checkpoint/storage/files.h"
#include "fsdp/errors.h"
#include "util/message.h"
#include "util/tensor_utils.h"

namespace fsdp {
namespace checkpoint {
namespace dcp {

using detail::msg;
using detail::quote;

namespace {

using pickle::Node;
using pickle::NodePtr;
using Kind = Node::Kind;

const char* const kMeta = "torch.distributed.checkpoint.metadata";
const char* const kOldMeta = "torch.distributed._shard.sharded_tensor.metadata";  // before 2.3
const char* const kFs = "torch.distributed.checkpoint.filesystem";

const std::vector<std::pair<at::ScalarType, const char*>>& dtype_table() {
  static const std::vector<std::pair<at::ScalarType, const char*>> t{
      {at::kFloat, "float32"},
      {at::kDouble, "float64"},
      {at::kHalf, "float16"},
      {at::kBFloat16, "bfloat16"},
      {at::kLong, "int64"},
      {at::kInt, "int32"},
      {at::kShort, "int16"},
      {at::kChar, "int8"},
      {at::kByte, "uint8"},
      {at::kBool, "bool"},
      {at::kComplexFloat, "complex64"},
      {at::kComplexDouble, "complex128"}};
  return t;
}

}  // namespace

const std::set<std::pair<std::string, std::string>>& metadata_globals() {
  static const std::set<std::pair<std::string, std::string>> g = [] {
    std::set<std::pair<std::string, std::string>> s;
    for (const char* c :
         {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
          "MetadataIndex", "StorageMeta", "TensorProperties", "_MEM_FORMAT_ENCODING"}) {
      s.insert({kMeta, c});
    }
    for (const char* c : {"TensorProperties", "MEM_FORMAT_ENCODING", "_MEM_FORMAT_ENCODING"}) {
      s.insert({kOldMeta, c});
    }
    s.insert({kFs, "_StorageInfo"});
    s.insert({"torch", "Size"});
    s.insert({"torch.serialization", "_get_layout"});
    for (const auto& [t, name] : dtype_table()) s.insert({"torch", name});
    for (const char* m : {"pathlib", "pathlib._local"}) {  // the module moved in Python 3.13
      for (const char* c : {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"})
        s.insert({m, c});
    }
    return s;
  }();
  return g;
}

namespace {

class Parser {
 public:
  explicit Parser(std::string what) : what_(std::move(what)) {}

  [[noreturn]] void fail(const std::string& where, const std::string& problem) const {
    throw CorruptionError(
        msg(what_, ": ", where.empty() ? std::string() : msg(where, ": "), problem));
  }

  // The attributes of a dataclass instance of one of `classes`: BUILD's dict, or the slots dict
  // of a (dict-or-None, slots) pair.
  NodePtr attrs(const NodePtr& obj, const std::vector<std::string>& classes,
                const std::string& where) const {
    std::string got =
        obj ? (obj->is(Kind::OBJECT) ? obj->class_name() : to_string(obj->kind)) : "null";
    bool ok = obj && obj->is(Kind::OBJECT);
    if (ok) {
      ok = false;
      for (const auto& c : classes) ok = ok || obj->class_name() == c;
    }
    if (!ok) fail(where, msg("expected ", classes.front(), ", found ", got));
    const NodePtr& st = obj->state;
    if (!st) return Node::dict({});
    if (st->is(Kind::DICT)) return st;
    if (st->is(Kind::TUPLE) && st->items.size() == 2 && st->items[1]->is(Kind::DICT)) {
      std::vector<std::pair<NodePtr, NodePtr>> all;
      if (st->items[0]->is(Kind::DICT)) all = st->items[0]->entries;
      all.insert(all.end(), st->items[1]->entries.begin(), st->items[1]->entries.end());
      return Node::dict(std::move(all));
    }
    fail(where, msg("unexpected state of ", got));
  }

  NodePtr field(const NodePtr& attrs, const std::string& name, const std::string& where,
                bool required = true) const {
    NodePtr v = attrs->get(name);
    if (!v && required) fail(where, msg("missing field ", quote(name)));
    return v;
  }

  int64_t integer(const NodePtr& n, const std::string& where) const {
    if (!n || !n->is(Kind::INT)) fail(where, "expected an int");
    return n->i;
  }

  std::string str(const NodePtr& n, const std::string& where) const {
    if (!n || !n->is(Kind::STR)) fail(where, "expected a str");
    return n->s;
  }

  // torch.Size((...)) or a plain tuple/list of ints.
  std::vector<int64_t> ints(const NodePtr& n, const std::string& where) const {
    const NodePtr* seq = &n;
    if (n && n->is(Kind::OBJECT) && n->class_name() == "torch.Size") {
      if (n->items.size() != 1) fail(where, "torch.Size takes one argument");
      seq = &n->items[0];
    }
    if (!*seq || !((*seq)->is(Kind::TUPLE) || (*seq)->is(Kind::LIST)))
      fail(where, "expected a torch.Size or a tuple of ints");
    std::vector<int64_t> out;
    for (const auto& x : (*seq)->items) out.push_back(integer(x, where));
    return out;
  }

  at::ScalarType dtype(const NodePtr& n, const std::string& where) const {
    if (n && n->is(Kind::GLOBAL) && n->module == "torch") {
      for (const auto& [t, name] : dtype_table())
        if (n->name == name) return t;
    }
    fail(where, msg("unknown dtype ", n ? n->class_name() : std::string("null")));
  }

  TensorMeta tensor(const NodePtr& obj, const std::string& key) const {
    const NodePtr a = attrs(obj, {std::string(kMeta) + ".TensorStorageMetadata"}, key);
    TensorMeta t;
    const NodePtr props = field(a, "properties", key);
    const std::string pw = msg(key, " (properties)");
    const std::vector<std::string> prop_classes{std::string(kMeta) + ".TensorProperties",
                                                std::string(kOldMeta) + ".TensorProperties"};
    if (props->is(Kind::OBJECT) && props->state && props->state->is(Kind::TUPLE) &&
        props->state->items.size() == 5) {
      // TensorProperties pickles its __getstate__ tuple:
      // (dtype, layout, requires_grad, memory_format, pin_memory).
      const std::string c = props->class_name();
      if (c != prop_classes[0] && c != prop_classes[1])
        fail(pw, msg("expected TensorProperties, found ", c));
      const auto& items = props->state->items;
      t.dtype = dtype(items[0], pw);
      if (!items[2]->is(Kind::BOOL)) fail(pw, "requires_grad must be a bool");
      t.requires_grad = items[2]->b;
    } else {  // a plain dataclass state
      const NodePtr pa = attrs(props, prop_classes, pw);
      t.dtype = dtype(field(pa, "dtype", pw), pw);
      const NodePtr rg = pa->get("requires_grad");
      t.requires_grad = rg && rg->is(Kind::BOOL) && rg->b;
    }
    t.size = ints(field(a, "size", key), msg(key, " (size)"));
    for (int64_t s : t.size)
      if (s < 0) fail(key, "negative size");
    const NodePtr chunks = field(a, "chunks", key);
    if (!chunks->is(Kind::LIST)) fail(key, "chunks must be a list");
    for (size_t i = 0; i < chunks->items.size(); ++i) {
      const std::string cw = msg(key, " (chunk ", i, ")");
      const NodePtr ca =
          attrs(chunks->items[i], {std::string(kMeta) + ".ChunkStorageMetadata"}, cw);
      ChunkMeta c{ints(field(ca, "offsets", cw), cw), ints(field(ca, "sizes", cw), cw)};
      if (c.offsets.size() != t.size.size() || c.sizes.size() != t.size.size())
        fail(cw, msg("has ", c.offsets.size(), " dims, the tensor ", t.size.size()));
      if (const int d = detail::dim_outside(c.offsets, c.sizes, t.size); d >= 0)
        fail(cw, msg("leaves the tensor in dim ", d));
      t.chunks.push_back(std::move(c));
    }
    return t;
  }

  std::string relative_path(const NodePtr& n, const std::string& where) const {
    std::string p;
    if (n && n->is(Kind::STR)) {
      p = n->s;
    } else if (n && n->is(Kind::OBJECT) &&
               (n->callee->module == "pathlib" || n->callee->module == "pathlib._local")) {
      if (n->items.size() != 1) fail(where, "a path of several parts");
      p = str(n->items[0], where);
    } else {
      fail(where, "relative_path must be a str or a pathlib path");
    }
    // A single file name: nothing may point outside the checkpoint directory.
    if (!files::plain_file_name(p))
      fail(where, msg("relative_path ", quote(files::printable(p)),
                      " is not a plain file name in the checkpoint directory"));
    return p;
  }

  Metadata run(const NodePtr& root) const {
    Metadata m;
    const NodePtr a = attrs(root, {std::string(kMeta) + ".Metadata"}, "");
    const NodePtr sdm = field(a, "state_dict_metadata", "");
    if (!sdm->is(Kind::DICT)) fail("state_dict_metadata", "must be a dict");
    for (const auto& [k, v] : sdm->entries) {
      const std::string key = str(k, "state_dict_metadata key");
      ItemMeta item;
      if (v && v->is(Kind::OBJECT) &&
          v->class_name() == std::string(kMeta) + ".BytesStorageMetadata") {
        item.bytes = true;
      } else {
        item.tensor = tensor(v, msg(quote(key)));
      }
      m.state_dict_metadata.emplace_back(key, std::move(item));
    }
    if (const NodePtr pd = a->get("planner_data"); pd && pd->is(Kind::DICT)) {
      for (const auto& [k, v] : pd->entries) {
        const std::string key = str(k, "planner_data key");
        std::vector<PathElement> path;
        if (!v->is(Kind::TUPLE) && !v->is(Kind::LIST))
          fail(msg("planner_data ", quote(key)), "must be a tuple");
        for (const auto& e : v->items) {
          if (e->is(Kind::STR)) {
            path.emplace_back(e->s);
          } else {
            path.emplace_back(integer(e, msg("planner_data ", quote(key))));
          }
        }
        m.planner_data.emplace_back(key, std::move(path));
      }
    }
    const NodePtr sd = field(a, "storage_data", "");
    if (!sd->is(Kind::DICT)) fail("storage_data", "must be a dict");
    std::set<std::string> seen;
    for (size_t i = 0; i < sd->entries.size(); ++i) {
      const auto& [k, v] = sd->entries[i];
      const std::string w = msg("storage_data entry ", i);
      const NodePtr ka = attrs(k, {std::string(kMeta) + ".MetadataIndex"}, w);
      Index idx;
      idx.fqn = str(field(ka, "fqn", w), msg(w, " (fqn)"));
      if (const NodePtr off = ka->get("offset"); off && !off->is(Kind::NONE))
        idx.offset = ints(off, msg(w, " (offset)"));
      if (const NodePtr ix = ka->get("index"); ix && !ix->is(Kind::NONE))
        idx.index = integer(ix, msg(w, " (index)"));
      const std::string vw = msg("storage_data ", quote(idx.fqn));
      const NodePtr va = attrs(v, {std::string(kFs) + "._StorageInfo"}, vw);
      StorageInfo info;
      info.relative_path = relative_path(field(va, "relative_path", vw), vw);
      info.offset = integer(field(va, "offset", vw), msg(vw, " (offset)"));
      info.length = integer(field(va, "length", vw), msg(vw, " (length)"));
      if (info.offset < 0 || info.length < 0) fail(vw, "negative offset or length");
      if (const NodePtr td = va->get("transform_descriptors");
          td && !td->is(Kind::NONE) && !(td->is(Kind::LIST) && td->items.empty()) &&
          !(td->is(Kind::TUPLE) && td->items.empty()))
        fail(vw, "transform_descriptors (compression, ...) are not supported");
      // Two entries for one chunk would leave a reader to pick one of them silently.
      std::string id = idx.fqn + (idx.offset ? std::string(1, '\0') : std::string());
      if (idx.offset)
        for (int64_t x : *idx.offset) id += std::to_string(x) + ",";
      if (!seen.insert(id).second) fail(vw, "is stored twice");
      m.storage_data.emplace_back(std::move(idx), std::move(info));
    }
    if (const NodePtr v = a->get("version"); v && v->is(Kind::STR)) m.version = v->s;
    return m;
  }

 private:
  std::string what_;
};

// ---- writing ----

NodePtr size_node(const std::vector<int64_t>& v) {
  std::vector<NodePtr> items;
  for (int64_t x : v) items.push_back(Node::integer(x));
  return Node::object(Node::global("torch", "Size"), {Node::tuple(std::move(items))}, false);
}

NodePtr dataclass(const char* module, const char* name,
                  std::vector<std::pair<NodePtr, NodePtr>> attrs) {
  return Node::object(Node::global(module, name), {}, true, Node::dict(std::move(attrs)));
}

NodePtr key(const std::string& s) { return Node::str(s); }

}  // namespace

std::string dtype_name(at::ScalarType t) {
  for (const auto& [d, name] : dtype_table())
    if (d == t) return name;
  throw ValueError(msg("DCP checkpoints cannot store dtype ", t));
}

Metadata parse_metadata(const std::string& bytes, const std::string& what) {
  pickle::NodePtr root;
  try {
    root = pickle::read(bytes, metadata_globals());
  } catch (const pickle::PickleError& e) {
    throw ValueError(msg(what, ": ", e.what()));
  }
  return Parser(what).run(root);
}

std::string serialize_metadata(const Metadata& m) {
  std::vector<std::pair<NodePtr, NodePtr>> sdm;
  for (const auto& [k, item] : m.state_dict_metadata) {
    if (item.bytes) {
      sdm.emplace_back(key(k), dataclass(kMeta, "BytesStorageMetadata", {}));
      continue;
    }
    const TensorMeta& t = item.tensor;
    // TensorProperties pickles its __getstate__ tuple.
    NodePtr props = Node::object(
        Node::global(kMeta, "TensorProperties"), {}, true,
        Node::tuple({Node::global("torch", dtype_name(t.dtype)),
                     Node::object(Node::global("torch.serialization", "_get_layout"),
                                  {Node::str("torch.strided")}, false),
                     Node::boolean(t.requires_grad),
                     Node::object(Node::global(kMeta, "_MEM_FORMAT_ENCODING"), {Node::integer(0)},
                                  false),  // TORCH_CONTIGUOUS_FORMAT
                     Node::boolean(false)}));
    std::vector<NodePtr> chunks;
    for (const auto& c : t.chunks) {
      chunks.push_back(
          dataclass(kMeta, "ChunkStorageMetadata",
                    {{key("offsets"), size_node(c.offsets)}, {key("sizes"), size_node(c.sizes)}}));
    }
    sdm.emplace_back(key(k), dataclass(kMeta, "TensorStorageMetadata",
                                       {{key("properties"), props},
                                        {key("size"), size_node(t.size)},
                                        {key("chunks"), Node::list(std::move(chunks))}}));
  }
  std::vector<std::pair<NodePtr, NodePtr>> pd;
  for (const auto& [k, path] : m.planner_data) {
    std::vector<NodePtr> items;
    for (const auto& e : path) {
      items.push_back(std::holds_alternative<std::string>(e) ? Node::str(std::get<std::string>(e))
                                                             : Node::integer(std::get<int64_t>(e)));
    }
    pd.emplace_back(key(k), Node::tuple(std::move(items)));
  }
  std::vector<std::pair<NodePtr, NodePtr>> sd;
  for (const auto& [idx, info] : m.storage_data) {
    NodePtr k = dataclass(kMeta, "MetadataIndex",
                          {{key("fqn"), Node::str(idx.fqn)},
                           {key("offset"), idx.offset ? size_node(*idx.offset) : Node::none()},
                           {key("index"), idx.index ? Node::integer(*idx.index) : Node::none()}});
    NodePtr v = dataclass(kFs, "_StorageInfo",
                          {{key("relative_path"), Node::str(info.relative_path)},
                           {key("offset"), Node::integer(info.offset)},
                           {key("length"), Node::integer(info.length)}});
    sd.emplace_back(k, v);
  }
  std::vector<std::pair<NodePtr, NodePtr>> attrs{
      {key("state_dict_metadata"), Node::dict(std::move(sdm))},
      {key("planner_data"), Node::dict(std::move(pd))},
      {key("storage_data"), Node::dict(std::move(sd))},
      {key("storage_meta"), Node::none()}};
  if (!m.version.empty()) attrs.emplace_back(key("version"), Node::str(m.version));
  return pickle::write(dataclass(kMeta, "Metadata", std::move(attrs)));
}

// ---- the wire form (encode_wire / decode_wire) ----
// Little-endian fixed-width integers; a string or vector is its count (u64) and then its
// elements. Layout: version, state_dict_metadata, planner_data, storage_data.

namespace {

class WireWriter {
 public:
  void u8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void i64(int64_t v) {
    const uint64_t u = static_cast<uint64_t>(v);
    for (int k = 0; k < 8; ++k) out_.push_back(static_cast<char>((u >> (8 * k)) & 0xff));
  }
  void str(const std::string& v) {
    i64(static_cast<int64_t>(v.size()));
    out_ += v;
  }
  void ints(const std::vector<int64_t>& v) {
    i64(static_cast<int64_t>(v.size()));
    for (int64_t x : v) i64(x);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class WireReader {
 public:
  WireReader(const std::string& b, const std::string& what) : b_(b), what_(what) {}
  [[noreturn]] void fail(const std::string& problem) const {
    throw CorruptionError(msg(what_, ": ", problem, " (at byte ", pos_, " of ", b_.size(), ")"));
  }
  uint8_t u8() {
    need(1);
    return static_cast<uint8_t>(b_[pos_++]);
  }
  int64_t i64() {
    need(8);
    uint64_t u = 0;
    for (int k = 0; k < 8; ++k)
      u |= static_cast<uint64_t>(static_cast<uint8_t>(b_[pos_ + k])) << (8 * k);
    pos_ += 8;
    return static_cast<int64_t>(u);
  }
  // A count of elements of at least `min_bytes` each: no larger than the bytes left can hold, so
  // a corrupt count cannot make a huge allocation.
  size_t count(size_t min_bytes) {
    const int64_t n = i64();
    if (n < 0 || static_cast<uint64_t>(n) > (b_.size() - pos_) / min_bytes)
      fail(msg("count ", n, " exceeds the message"));
    return static_cast<size_t>(n);
  }
  std::string str() {
    const size_t n = count(1);
    std::string s = b_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::vector<int64_t> ints() {
    std::vector<int64_t> v(count(8));
    for (int64_t& x : v) x = i64();
    return v;
  }
  bool done() const { return pos_ == b_.size(); }

 private:
  void need(size_t n) const {
    if (b_.size() - pos_ < n) fail("truncated");
  }
  const std::string& b_;
  const std::string& what_;
  size_t pos_ = 0;
};

}  // namespace

std::string encode_wire(const Metadata& m) {
  WireWriter w;
  w.str(m.version);
  w.i64(static_cast<int64_t>(m.state_dict_metadata.size()));
  for (const auto& [k, item] : m.state_dict_metadata) {
    w.str(k);
    w.u8(item.bytes ? 1 : 0);
    if (item.bytes) continue;
    const TensorMeta& t = item.tensor;
    w.i64(static_cast<int64_t>(t.dtype));
    w.u8(t.requires_grad ? 1 : 0);
    w.ints(t.size);
    w.i64(static_cast<int64_t>(t.chunks.size()));
    for (const ChunkMeta& c : t.chunks) {
      w.ints(c.offsets);
      w.ints(c.sizes);
    }
  }
  w.i64(static_cast<int64_t>(m.planner_data.size()));
  for (const auto& [k, path] : m.planner_data) {
    w.str(k);
    w.i64(static_cast<int64_t>(path.size()));
    for (const PathElement& e : path) {
      if (const auto* s = std::get_if<std::string>(&e)) {
        w.u8(0);
        w.str(*s);
      } else {
        w.u8(1);
        w.i64(std::get<int64_t>(e));
      }
    }
  }
  w.i64(static_cast<int64_t>(m.storage_data.size()));
  for (const auto& [idx, info] : m.storage_data) {
    w.str(idx.fqn);
    w.u8(idx.offset ? 1 : 0);
    if (idx.offset) w.ints(*idx.offset);
    w.u8(idx.index ? 1 : 0);
    if (idx.index) w.i64(*idx.index);
    w.str(info.relative_path);
    w.i64(info.offset);
    w.i64(info.length);
  }
  return w.take();
}

Metadata decode_wire(const std::string& bytes, const std::string& what) {
  WireReader r(bytes, what);
  Metadata m;
  m.version = r.str();
  for (size_t n = r.count(9), i = 0; i < n; ++i) {
    std::string key = r.str();
    ItemMeta item;
    const uint8_t kind = r.u8();
    if (kind > 1) r.fail(msg("item ", quote(key), " has kind ", kind));
    item.bytes = kind == 1;
    if (!item.bytes) {
      TensorMeta& t = item.tensor;
      const int64_t dt = r.i64();
      bool known = false;
      for (const auto& [d, name] : dtype_table()) known |= static_cast<int64_t>(d) == dt;
      if (!known) r.fail(msg("item ", quote(key), " has dtype code ", dt));
      t.dtype = static_cast<at::ScalarType>(dt);
      t.requires_grad = r.u8() != 0;
      t.size = r.ints();
      for (int64_t s : t.size)
        if (s < 0) r.fail(msg("item ", quote(key), " has a negative size"));
      for (size_t nc = r.count(16), c = 0; c < nc; ++c) {
        ChunkMeta ch{r.ints(), r.ints()};
        if (ch.offsets.size() != t.size.size() || ch.sizes.size() != t.size.size())
          r.fail(msg("item ", quote(key), " has a chunk of another rank than the tensor"));
        if (const int d = detail::dim_outside(ch.offsets, ch.sizes, t.size); d >= 0)
          r.fail(msg("item ", quote(key), " has a chunk leaving the tensor in dim ", d));
        t.chunks.push_back(std::move(ch));
      }
    }
    m.state_dict_metadata.emplace_back(std::move(key), std::move(item));
  }
  for (size_t n = r.count(16), i = 0; i < n; ++i) {
    std::string key = r.str();
    std::vector<PathElement> path;
    for (size_t np = r.count(9), j = 0; j < np; ++j) {
      const uint8_t tag = r.u8();
      if (tag == 0) {
        path.emplace_back(r.str());
      } else if (tag == 1) {
        path.emplace_back(r.i64());
      } else {
        r.fail(msg("planner path of ", quote(key), " has tag ", tag));
      }
    }
    m.planner_data.emplace_back(std::move(key), std::move(path));
  }
  for (size_t n = r.count(34), i = 0; i < n; ++i) {
    Index idx;
    idx.fqn = r.str();
    if (r.u8()) idx.offset = r.ints();
    if (r.u8()) idx.index = r.i64();
    StorageInfo info;
    info.relative_path = r.str();
    if (!files::plain_file_name(info.relative_path))
      r.fail(msg("storage of ", quote(idx.fqn),
                 " is not a plain file name in the checkpoint directory"));
    info.offset = r.i64();
    info.length = r.i64();
    if (info.offset < 0 || info.length < 0)
      r.fail(msg("storage of ", quote(idx.fqn), " has a negative offset or length"));
    m.storage_data.emplace_back(std::move(idx), std::move(info));
  }
  if (!r.done()) r.fail("trailing bytes");
  return m;
}

}  // namespace dcp
}  // namespace checkpoint
}  // namespace fsdp
