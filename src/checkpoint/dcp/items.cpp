// DCP items of a StateDict (items.h): key flattening and torch.save archive payloads.
// Tensors go through torch::pickle_save / pickle_load; other values are our own protocol-2 pickle
// in LibTorch's zip container, read back through the restricted reader.
#include "checkpoint/dcp/items.h"

#include <torch/serialize.h>

#include <algorithm>
#include <cstring>

#include "checkpoint/formats/pickle.h"
#include "checkpoint/formats/tensor_formats.h"
#include "checkpoint/formats/torch_archive.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace items {

using detail::msg;
using detail::quote;

namespace {

using pickle::Node;
using pickle::NodePtr;

// DCP's rule (_traverse_state_dict, 2.4+): a list is descended into if it holds a dict, a tensor
// or a list that is itself descended into; otherwise it is one value (a list of strings, betas).
bool descend(const StateValue& list) {
  for (const auto& x : list.list()) {
    if (x.is_dict() || x.is_tensor() || x.is_sharded_tensor()) return true;
    if (x.is_list() && descend(x)) return true;
  }
  return false;
}

// DCP's traversal: dicts always, lists where `descend` says so.
void flatten(StateValue& v, const std::string& key, std::vector<dcp::PathElement>& path,
             std::vector<FlatItem>& out) {
  if (v.is_dict()) {
    for (auto& [k, x] : v.dict()) {
      path.emplace_back(k);
      flatten(x, key.empty() ? k : key + "." + k, path, out);
      path.pop_back();
    }
  } else if (v.is_list() && descend(v)) {
    for (size_t i = 0; i < v.list().size(); ++i) {
      path.emplace_back(static_cast<int64_t>(i));
      flatten(v.list()[i], key + "." + std::to_string(i), path, out);
      path.pop_back();
    }
  } else {
    out.push_back(FlatItem{key, path, &v});
  }
}

}  // namespace

std::vector<FlatItem> flatten(StateDict& sd) {
  std::vector<FlatItem> out;
  std::vector<dcp::PathElement> path;
  for (auto& [k, v] : sd) {
    path.emplace_back(k);
    flatten(v, k, path, out);
    path.pop_back();
  }
  return out;
}

// ---- item payloads ----

void write_tensor_item(const at::Tensor& t, const ByteSink& sink) {
  const at::Tensor c = t.detach().to(at::kCPU).contiguous();
  if (formats::find_storage_class(c.scalar_type())) {
    archive::write_tensor_archive(c, sink);
    return;
  }
  // A view would drag its whole storage into the archive (DCP clones such tensors too).
  at::Tensor own = c;
  if (c.storage_offset() != 0 ||
      c.storage().nbytes() != static_cast<size_t>(c.numel()) * c.element_size())
    own = c.clone();
  const std::vector<char> bytes = torch::pickle_save(own);
  sink(bytes.data(), bytes.size());
}

namespace {

NodePtr to_node(const StateValue& v, const std::string& key) {
  switch (v.kind()) {
    case StateValue::Kind::NONE:
      return Node::none();
    case StateValue::Kind::BOOL:
      return Node::boolean(v.to_bool());
    case StateValue::Kind::INT:
      return Node::integer(v.to_int());
    case StateValue::Kind::DOUBLE:
      return Node::real(v.to_double());
    case StateValue::Kind::STRING:
      return Node::str(v.string());
    case StateValue::Kind::LIST: {
      std::vector<NodePtr> items;
      for (const auto& x : v.list()) items.push_back(to_node(x, key));
      return Node::list(std::move(items));
    }
    case StateValue::Kind::DICT: {
      std::vector<std::pair<NodePtr, NodePtr>> entries;
      for (const auto& [k, x] : v.dict()) entries.emplace_back(Node::str(k), to_node(x, key));
      return Node::dict(std::move(entries));
    }
    default:
      throw ValueError(msg("checkpoint save: ", quote(key), " holds a ", to_string(v.kind()),
                           " inside a value DCP stores as bytes"));
  }
}

}  // namespace

std::string value_payload(const StateValue& v, const std::string& key) {
  const std::string pkl = pickle::write(to_node(v, key));
  std::string out;
  archive::ArchiveWriter zip([&out](const char* data, size_t n) { out.append(data, n); });
  zip.record("data.pkl", pkl.data(), pkl.size());
  zip.finish();
  return out;
}

namespace {

// The archive an item's bytes hold, and the values of its data.pkl: storages are views of the
// bytes where they lie (no copy), CRC-checked when asked.
struct ItemArchive {
  ItemParts item;
  archive::ReadFn read;
  archive::Directory dir;
  archive::Values values;
  // `views`: storages are views of the bytes; otherwise copies (values outlive the buffer).
  ItemArchive(ItemParts parts, const std::string& where, bool check_crc, bool views)
      : item(std::move(parts)),
        read([this, where](int64_t off, size_t len, char* dst) {
          const size_t n = item.size;
          if (off < 0 || static_cast<uint64_t>(off) > n || len > n - static_cast<size_t>(off))
            throw ValueError(msg(where, ": a read past the end of the item"));
          const auto end = static_cast<size_t>(off) + len;
          for (const ItemParts::Part& p : item.parts) {
            const size_t lo = std::max(static_cast<size_t>(off), static_cast<size_t>(p.offset));
            const size_t hi = std::min(end, static_cast<size_t>(p.offset) + p.n);
            if (lo < hi)
              std::memcpy(dst + (lo - static_cast<size_t>(off)), p.data + (lo - p.offset), hi - lo);
          }
        }),
        dir(static_cast<int64_t>(item.size), read, where),
        values(
            [this, where, check_crc, views](const std::string& key, at::ScalarType dtype,
                                            int64_t numel) {
              const archive::Record& r = archive::storage_record(dir, key, dtype, numel);
              const char* p = nullptr;
              for (const ItemParts::Part& part : item.parts)
                if (r.offset >= part.offset &&
                    static_cast<uint64_t>(r.offset - part.offset) + static_cast<uint64_t>(r.size) <=
                        part.n)
                  p = part.data + (r.offset - part.offset);
              if (!p)
                throw ValueError(msg(where, ": storage ", key,
                                     " does not lie where the item was read to hold it"));
              if (check_crc && archive::crc32(p, static_cast<size_t>(r.size)) != r.crc32)
                throw ValueError(
                    msg(where, ": storage ", key, " fails its CRC-32: the file is corrupt"));
              at::Tensor t =
                  at::from_blob(const_cast<char*>(p), {numel}, at::TensorOptions().dtype(dtype));
              return views ? t : t.clone();
            },
            static_cast<int64_t>(item.size), where) {}
};

ItemParts whole(const char* data, size_t n) { return ItemParts{{{0, n, data}}, n}; }

}  // namespace

at::Tensor decode_tensor(const char* data, size_t n, const std::string& where, bool check_crc) {
  return decode_tensor(whole(data, n), where, check_crc);
}

at::Tensor decode_tensor(const ItemParts& item, const std::string& where, bool check_crc) {
  ItemArchive a(item, where, check_crc, /*views=*/true);
  const pickle::NodePtr root = archive::read_data_pkl(a.dir, a.read, check_crc);
  if (!root->is(Node::Kind::OBJECT) || root->class_name() != "torch._utils._rebuild_tensor_v2")
    throw ValueError(msg(
        where, " is not a readable tensor: it holds a ",
        root->is(Node::Kind::OBJECT) ? root->class_name() : std::string(to_string(root->kind))));
  return a.values.tensor(*root, "the chunk");
}

StateValue decode_value(const char* data, size_t n, const std::string& where, bool check_crc) {
  ItemArchive a(whole(data, n), where, check_crc, /*views=*/false);
  return a.values.value(archive::read_data_pkl(a.dir, a.read, check_crc), "the value");
}

}  // namespace items
}  // namespace checkpoint
}  // namespace fsdp
