// torch.save archives without LibTorch's reader (torch_archive.h). The zip rules used are those
// of PKWARE's APPNOTE for stored records; every number read from the archive is checked against
// the archive's size before it is used.
#include "checkpoint/formats/torch_archive.h"

#include <climits>
#include <cstring>

#include <isa-l/crc.h>

#include "checkpoint/formats/tensor_formats.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace archive {

using detail::msg;
using detail::quote;

namespace {

constexpr uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEndSig = 0x06054b50,
                   kZip64EndSig = 0x06064b50, kZip64LocatorSig = 0x07064b50;
constexpr size_t kEndSize = 22, kCentralSize = 46, kLocalSize = 30, kLocatorSize = 20,
                 kZip64EndSize = 56;
constexpr int64_t kMaxDirectory = int64_t{64} << 20;  // bytes of central directory we accept
constexpr int64_t kMaxRecords = 1 << 20;

uint64_t le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// A central directory entry's fields, with the ZIP64 values of those that overflowed.
struct CentralEntry {
  std::string name;
  uint64_t flags = 0, method = 0, crc = 0, csize = 0, usize = 0, local = 0;
};

// Reads an archive's zip directory in the order of the format: the end record, found from the
// end of the file; the ZIP64 end record it may point at; then the central directory's entries,
// each checked against the file and its local header. Every failure names `where`.
class DirectoryReader {
 public:
  DirectoryReader(int64_t size, const ReadFn& read, const std::string& where)
      : size_(size), read_(read), where_(where) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw ValueError(msg(where_, ": not a torch.save archive: ", what));
  }

  // Where the central directory lies and how many entries it holds, checked against the file.
  struct Place {
    uint64_t count = 0, size = 0, offset = 0;
  };
  Place directory_place() const;
  // The entry at `pos` of the central directory `dir`; `pos` moves past it.
  CentralEntry entry(const std::string& dir, size_t& pos) const;
  // Where the data of `c`'s record lies, from its local header, checked to end before the
  // directory at `dir_offset`.
  Record record(const CentralEntry& c, uint64_t dir_offset) const;

 private:
  // The end-of-directory record's fixed part, and where it starts in the archive.
  struct EndRecord {
    char bytes[kEndSize];
    int64_t at = 0;
  };
  EndRecord end_record() const;
  // The directory's place from the ZIP64 end record, which the locator just before the end
  // record at `end_at` points at.
  Place zip64_place(int64_t end_at) const;

  int64_t size_;
  const ReadFn& read_;
  const std::string& where_;
};

DirectoryReader::EndRecord DirectoryReader::end_record() const {
  if (size_ < static_cast<int64_t>(kEndSize)) fail("it is too short to be a zip file");
  // The end record sits in the last 22 + 65535 bytes (its comment may be up to 64 KiB). torch.save
  // writes no comment, so the last 22 bytes are read first, and the whole window only if they are
  // not the record (the backward search over the window stops at that same record when they are):
  // a chunk read straight into its tensor (load/load.cpp) reads its directory from the file.
  std::string tail;
  int64_t tail_n = 0, end = -1;
  for (const int64_t window :
       {static_cast<int64_t>(kEndSize), static_cast<int64_t>(kEndSize) + 0xFFFF}) {
    tail_n = std::min<int64_t>(size_, window);
    tail.assign(static_cast<size_t>(tail_n), '\0');
    read_(size_ - tail_n, tail.size(), tail.data());
    for (int64_t i = tail_n - static_cast<int64_t>(kEndSize); i >= 0; --i) {
      if (le(&tail[i], 4) == kEndSig && i + kEndSize + le(&tail[i + 20], 2) == tail.size()) {
        end = i;
        break;
      }
    }
    if (end >= 0 || tail_n == size_) break;
  }
  if (end < 0) fail("no zip end-of-directory record");
  EndRecord rec;
  std::memcpy(rec.bytes, &tail[end], kEndSize);
  rec.at = size_ - tail_n + end;
  return rec;
}

DirectoryReader::Place DirectoryReader::zip64_place(int64_t end_at) const {
  // ZIP64: a locator just before the end record points at the ZIP64 end record.
  const int64_t locator = end_at - static_cast<int64_t>(kLocatorSize);
  if (locator < 0) fail("a ZIP64 archive without its locator");
  char loc[kLocatorSize];
  read_(locator, kLocatorSize, loc);
  if (le(loc, 4) != kZip64LocatorSig) fail("a ZIP64 archive without its locator");
  const uint64_t at = le(loc + 8, 8);
  if (static_cast<uint64_t>(locator) < kZip64EndSize ||
      at > static_cast<uint64_t>(locator) - kZip64EndSize)
    fail("its ZIP64 end record lies outside the file");
  char z[kZip64EndSize];
  read_(static_cast<int64_t>(at), kZip64EndSize, z);
  if (le(z, 4) != kZip64EndSig) fail("its ZIP64 end record is missing");
  return Place{le(z + 32, 8), le(z + 40, 8), le(z + 48, 8)};
}

DirectoryReader::Place DirectoryReader::directory_place() const {
  const EndRecord end = end_record();
  const char* e = end.bytes;
  Place p{le(e + 10, 2), le(e + 12, 4), le(e + 16, 4)};
  if (le(e + 4, 2) != 0 || le(e + 6, 2) != 0) fail("a multi-disk zip");
  if (p.count == 0xFFFF || p.size == 0xFFFFFFFF || p.offset == 0xFFFFFFFF) p = zip64_place(end.at);
  if (p.count > static_cast<uint64_t>(kMaxRecords)) fail("it claims too many records");
  if (p.size > static_cast<uint64_t>(kMaxDirectory) || p.offset > static_cast<uint64_t>(size_) ||
      p.size > static_cast<uint64_t>(size_) - p.offset)
    fail("its directory lies outside the file");
  return p;
}

CentralEntry DirectoryReader::entry(const std::string& dir, size_t& pos) const {
  if (dir.size() - pos < kCentralSize || le(&dir[pos], 4) != kCentralSig)
    fail("its directory is truncated or damaged");
  const char* c = &dir[pos];
  CentralEntry out;
  out.flags = le(c + 8, 2);
  out.method = le(c + 10, 2);
  out.crc = le(c + 16, 4);
  out.csize = le(c + 20, 4);
  out.usize = le(c + 24, 4);
  out.local = le(c + 42, 4);
  const size_t name_n = le(c + 28, 2), extra_n = le(c + 30, 2), comment_n = le(c + 32, 2);
  if (dir.size() - pos - kCentralSize < name_n + extra_n + comment_n)
    fail("its directory is truncated or damaged");
  out.name.assign(c + kCentralSize, name_n);
  const std::string& name = out.name;
  // ZIP64 sizes and offset, for the fields that overflowed.
  for (size_t x = 0; x + 4 <= extra_n;) {
    const char* f = c + kCentralSize + name_n + x;
    const size_t id = le(f, 2), len = le(f + 2, 2);
    if (x + 4 + len > extra_n) fail(msg("record ", quote(name), " has a damaged extra field"));
    if (id == 0x0001) {
      size_t k = 4;
      auto take = [&](uint64_t& v) {
        if (v != 0xFFFFFFFF) return;
        if (k + 8 > 4 + len) fail(msg("record ", quote(name), " has a short ZIP64 field"));
        v = le(f + k, 8);
        k += 8;
      };
      take(out.usize);
      take(out.csize);
      take(out.local);
    }
    x += 4 + len;
  }
  pos += kCentralSize + name_n + extra_n + comment_n;
  return out;
}

Record DirectoryReader::record(const CentralEntry& c, uint64_t dir_offset) const {
  if (c.local > static_cast<uint64_t>(size_) - kLocalSize)
    fail(msg("record ", quote(c.name), " starts outside the file"));
  char lh[kLocalSize];
  read_(static_cast<int64_t>(c.local), kLocalSize, lh);
  if (le(lh, 4) != kLocalSig) fail(msg("record ", quote(c.name), " has no local header"));
  const uint64_t data = c.local + kLocalSize + le(lh + 26, 2) + le(lh + 28, 2);
  if (data > dir_offset || c.usize > dir_offset - data)
    fail(msg("record ", quote(c.name), " extends past the file's data"));
  return Record{static_cast<int64_t>(data), static_cast<int64_t>(c.usize),
                static_cast<uint32_t>(c.crc)};
}

}  // namespace

uint32_t crc32(const char* data, size_t n, uint32_t crc) {
  return crc32_gzip_refl(crc, reinterpret_cast<const unsigned char*>(data), n);
}

Directory::Directory(int64_t size, const ReadFn& read, std::string where)
    : where_(std::move(where)), size_(size) {
  const DirectoryReader zip(size, read, where_);
  const DirectoryReader::Place place = zip.directory_place();
  std::string dir(static_cast<size_t>(place.size), '\0');
  read(static_cast<int64_t>(place.offset), dir.size(), dir.data());

  std::string folder;
  size_t pos = 0;
  for (uint64_t r = 0; r < place.count; ++r) {
    const CentralEntry c = zip.entry(dir, pos);
    const std::string& name = c.name;
    if (c.method != 0)
      zip.fail(msg("record ", quote(name), " is compressed; torch.save stores records"));
    if (c.flags & 1) zip.fail(msg("record ", quote(name), " is encrypted"));
    if (c.csize != c.usize) zip.fail(msg("record ", quote(name), " has two sizes"));
    const size_t slash = name.find('/');
    if (slash == std::string::npos || slash == 0)
      zip.fail(msg("record ", quote(name), " is in no folder"));
    if (folder.empty()) folder = name.substr(0, slash);
    if (name.compare(0, slash, folder) != 0 || slash != folder.size())
      zip.fail(msg("records lie in two folders (", quote(folder), " and ",
                   quote(name.substr(0, slash)), ")"));
    const Record rec = zip.record(c, place.offset);
    if (!records_.emplace(name.substr(slash + 1), rec).second)
      zip.fail(msg("record ", quote(name), " appears twice"));
  }
}

const Record* Directory::find(const std::string& name) const {
  auto it = records_.find(name);
  return it == records_.end() ? nullptr : &it->second;
}

const Record& storage_record(const Directory& dir, const std::string& key, at::ScalarType dtype,
                             int64_t numel) {
  const Record* r = dir.find("data/" + key);
  if (!r) throw ValueError(msg(dir.where(), ": the storage record data/", key, " is missing"));
  const int64_t want = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (r->size != want)
    throw ValueError(msg(dir.where(), ": the storage record data/", key, " has ", r->size,
                         " bytes, its tensor needs ", want));
  return *r;
}

const std::set<std::pair<std::string, std::string>>& pickle_globals() {
  static const std::set<std::pair<std::string, std::string>> g = [] {
    std::set<std::pair<std::string, std::string>> s = {
        {"torch._utils", "_rebuild_tensor_v2"},
        {"collections", "OrderedDict"},
    };
    for (const auto& d : formats::dtype_names()) s.insert({"torch", d.storage});
    return s;
  }();
  return g;
}

pickle::NodePtr read_data_pkl(const Directory& dir, const ReadFn& read, bool check_crc) {
  if (dir.find("constants.pkl"))
    throw ValueError(msg(dir.where(),
                         ": a TorchScript archive (torch::save, torch.jit.save), not a torch.save "
                         "archive of data; read it with torch::load"));
  if (const Record* order = dir.find("byteorder")) {
    std::string b(static_cast<size_t>(std::min<int64_t>(order->size, 16)), '\0');
    read(order->offset, b.size(), b.data());
    if (b != "little") throw ValueError(msg(dir.where(), ": stored in ", b, "-endian byte order"));
  }
  const Record* pkl = dir.find("data.pkl");
  if (!pkl) throw ValueError(msg(dir.where(), ": not a torch.save archive: it has no data.pkl"));
  pickle::ReadLimits limits;
  limits.persistent_ids = true;
  if (pkl->size > static_cast<int64_t>(limits.max_bytes))
    throw ValueError(msg(dir.where(), ": data.pkl is larger than ", limits.max_bytes, " bytes"));
  std::string bytes(static_cast<size_t>(pkl->size), '\0');
  read(pkl->offset, bytes.size(), bytes.data());
  if (check_crc && crc32(bytes.data(), bytes.size()) != pkl->crc32)
    throw CorruptionError(msg(dir.where(), ": data.pkl fails its CRC-32: the file is corrupt"));
  try {
    return pickle::read(bytes, pickle_globals(), limits);
  } catch (const pickle::PickleError& e) {
    throw ValueError(msg(dir.where(), ": ", e.what()));
  }
}

void Values::fail(const std::string& what) const { throw ValueError(msg(where_, ": ", what)); }

StateValue Values::value(const pickle::NodePtr& n, const std::string& name, int depth) {
  using K = pickle::Node::Kind;
  if (depth > 64) fail(msg(name, " is nested deeper than 64 levels"));
  switch (n->kind) {
    case K::NONE:
      return StateValue();
    case K::BOOL:
      return StateValue(n->b);
    case K::INT:
      return StateValue(n->i);
    case K::FLOAT:
      return StateValue(n->f);
    case K::STR:
      return StateValue(n->s);
    case K::LIST:
    case K::TUPLE: {
      StateList l;
      for (size_t i = 0; i < n->items.size(); ++i)
        l.push_back(value(n->items[i], msg(name, "[", i, "]"), depth + 1));
      return StateValue(std::move(l));
    }
    case K::DICT: {
      StateDict d;
      for (const auto& [k, v] : n->entries) {
        if (!k->is(K::STR)) fail(msg(name, " has a key that is not a str"));
        d.insert_or_assign(k->s, value(v, name.empty() ? k->s : msg(name, ".", k->s), depth + 1));
      }
      return StateValue(std::move(d));
    }
    case K::OBJECT:
      if (n->class_name() == "torch._utils._rebuild_tensor_v2") return tensor(*n, name);
      fail(msg(name, " is a ", n->class_name(), ", which fsdp-cpp does not read"));
    default:
      fail(msg(name, " is a Python ", pickle::to_string(n->kind),
               ", which a StateDict cannot hold"));
  }
}

std::vector<int64_t> Values::ints(const pickle::NodePtr& n, const std::string& what) const {
  if (!n->is(pickle::Node::Kind::TUPLE)) fail(msg(what, " is not a tuple"));
  std::vector<int64_t> out;
  for (const auto& x : n->items) {
    if (!x->is(pickle::Node::Kind::INT)) fail(msg(what, " holds a non-integer"));
    out.push_back(x->i);
  }
  return out;
}

at::Tensor Values::tensor(const pickle::Node& call, const std::string& name) {
  using K = pickle::Node::Kind;
  const auto& a = call.items;
  if (call.class_name() != "torch._utils._rebuild_tensor_v2" || a.size() < 4 ||
      !a[0]->is(K::PERS_ID) || !a[1]->is(K::INT))
    fail(msg("tensor ", quote(name), " has unexpected _rebuild_tensor_v2 arguments"));
  const pickle::NodePtr& pid = a[0]->items[0];
  if (!pid->is(K::TUPLE) || pid->items.size() != 5 || !pid->items[0]->is(K::STR) ||
      pid->items[0]->s != "storage" || !pid->items[1]->is(K::GLOBAL) ||
      !pid->items[2]->is(K::STR) || !pid->items[4]->is(K::INT))
    fail(msg("tensor ", quote(name), " refers to its storage in an unexpected way"));
  at::ScalarType dtype = at::kFloat;
  bool known = false;
  for (const auto& d : formats::dtype_names())
    if (pid->items[1]->name == d.storage) {
      dtype = d.dtype;
      known = true;
    }
  if (!known) fail(msg("tensor ", quote(name), " has storage class ", pid->items[1]->class_name()));
  const std::string key = pid->items[2]->s;
  const int64_t numel = pid->items[4]->i;
  const auto item = static_cast<int64_t>(c10::elementSize(dtype));
  if (numel < 0 || numel > archive_size_ / item)
    fail(msg("tensor ", quote(name), " claims a storage of ", numel,
             " elements, more than the archive holds"));
  at::Tensor storage = storage_of(key, dtype, numel, name);
  const int64_t offset = a[1]->i;
  const std::vector<int64_t> size = ints(a[2], msg("the size of ", quote(name)));
  const std::vector<int64_t> stride = ints(a[3], msg("the stride of ", quote(name)));
  if (size.size() != stride.size())
    fail(msg("tensor ", quote(name), ": size and stride differ in length"));
  // The furthest element must lie inside the storage.
  int64_t last = offset;
  bool empty = false;
  for (size_t d = 0; d < size.size(); ++d) {
    if (size[d] < 0 || stride[d] < 0)
      fail(msg("tensor ", quote(name), ": negative size or stride"));
    if (size[d] == 0) empty = true;
  }
  if (!empty) {
    for (size_t d = 0; d < size.size(); ++d) {
      if (stride[d] != 0 && size[d] - 1 > (INT64_MAX - last) / stride[d])
        fail(msg("tensor ", quote(name), ": its extent overflows"));
      last += (size[d] - 1) * stride[d];
    }
    if (offset < 0 || last >= numel)
      fail(msg("tensor ", quote(name), " reaches element ", last, " of a storage of ", numel));
  }
  return storage.as_strided(size, stride, empty ? 0 : offset);
}

at::Tensor Values::storage_of(const std::string& key, at::ScalarType dtype, int64_t numel,
                              const std::string& name) {
  auto it = storages_.find(key);
  if (it != storages_.end()) {
    if (it->second.scalar_type() != dtype || it->second.numel() != numel)
      fail(msg("storage ", key, " is used with two dtypes or sizes"));
    return it->second;
  }
  if (key.empty() || key.find('/') != std::string::npos)
    fail(msg("tensor ", quote(name), " names a storage ", quote(key)));
  at::Tensor t = storage_(key, dtype, numel);
  storages_[key] = t;
  return t;
}

ArchiveWriter::ArchiveWriter(Sink sink) : sink_(std::move(sink)) {
  zip_ = std::make_unique<caffe2::serialize::PyTorchStreamWriter>(
      [this](const void* data, size_t n) -> size_t {
        if (error_) return n;  // dropped: the error is reported by finish()
        try {
          sink_(static_cast<const char*>(data), n);
        } catch (...) {
          error_ = std::current_exception();
        }
        return n;
      });
}

ArchiveWriter::~ArchiveWriter() = default;

void ArchiveWriter::record(const std::string& name, const void* data, size_t n) {
  zip_->writeRecord(name, n ? data : nullptr, n);
}

void ArchiveWriter::finish() {
  zip_->writeEndOfFile();
  if (error_) std::rethrow_exception(error_);
}

namespace {

// Little-endian fields of the zip headers.
void put16(std::string& b, uint64_t v) {
  for (int k = 0; k < 2; ++k) b.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}
void put32(std::string& b, uint64_t v) {
  for (int k = 0; k < 4; ++k) b.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

// Our zip writer for archives without ZIP64: each record (local header, then the data) goes to
// the sink as it is added; finish() writes the central directory and its end record.
class SmallZipWriter {
 public:
  explicit SmallZipWriter(const ArchiveWriter::Sink& sink) : sink_(sink) {}
  void add(const std::string& name, const char* data, uint64_t n);
  void finish();

 private:
  struct Entry {
    std::string name;
    uint32_t crc;
    uint64_t size, offset;
  };
  const ArchiveWriter::Sink& sink_;
  std::vector<Entry> entries_;
  uint64_t pos_ = 0;
  std::string head_;  // the local header being written, its memory reused
};

void SmallZipWriter::add(const std::string& name, const char* data, uint64_t n) {
  const std::string full = "archive/" + name;
  const uint32_t crc = crc32(data, n);
  // An extra field ('FB', as LibTorch's writer uses) pads the header so that the data starts
  // on a 64-byte boundary, as in torch.save files.
  const uint64_t unpadded = pos_ + 30 + full.size() + 4;
  const uint64_t pad = (64 - unpadded % 64) % 64;
  head_.clear();
  put32(head_, 0x04034b50);  // local file header
  put16(head_, 20);          // version needed: 2.0
  put16(head_, 0);           // flags
  put16(head_, 0);           // stored
  put16(head_, 0);           // time
  put16(head_, 0x21);        // date: 1980-01-01
  put32(head_, crc);
  put32(head_, n);  // compressed size
  put32(head_, n);  // uncompressed size
  put16(head_, full.size());
  put16(head_, 4 + pad);
  head_ += full;
  put16(head_, 0x4246);  // "FB"
  put16(head_, pad);
  head_.append(pad, 'Z');
  sink_(head_.data(), head_.size());
  if (n) sink_(data, n);
  entries_.push_back({full, crc, n, pos_});
  pos_ += head_.size() + n;
}

void SmallZipWriter::finish() {
  std::string dir;
  for (const Entry& e : entries_) {
    put32(dir, 0x02014b50);  // central directory header
    put16(dir, 20);          // made by: 2.0
    put16(dir, 20);          // needed: 2.0
    put16(dir, 0);
    put16(dir, 0);
    put16(dir, 0);
    put16(dir, 0x21);
    put32(dir, e.crc);
    put32(dir, e.size);
    put32(dir, e.size);
    put16(dir, e.name.size());
    put16(dir, 0);  // extra
    put16(dir, 0);  // comment
    put16(dir, 0);  // disk
    put16(dir, 0);  // internal attributes
    put32(dir, 0);  // external attributes
    put32(dir, e.offset);
    dir += e.name;
  }
  const uint64_t dir_offset = pos_;
  const uint64_t dir_size = dir.size();
  put32(dir, 0x06054b50);  // end of central directory
  put16(dir, 0);
  put16(dir, 0);
  put16(dir, entries_.size());
  put16(dir, entries_.size());
  put32(dir, dir_size);
  put32(dir, dir_offset);
  put16(dir, 0);
  sink_(dir.data(), dir.size());
}

}  // namespace

void write_tensor_archive(const at::Tensor& t, const ArchiveWriter::Sink& sink) {
  const std::string pkl = pickle::write(
      tensor_node(t.scalar_type(), "0", t.sizes(), t.strides(), t.numel(), "tensor item"));
  const uint64_t nbytes = static_cast<uint64_t>(t.numel()) * t.element_size();
  // The records torch.save writes, in its order (LibTorch's writer adds `version` itself).
  struct Rec {
    const char* name;
    const char* data;
    uint64_t size;
  };
  const Rec records[] = {{"data.pkl", pkl.data(), pkl.size()},
                         {"byteorder", "little", 6},
                         {"data/0", static_cast<const char*>(t.data_ptr()), nbytes}};
  // Past 32-bit sizes and offsets a ZIP64 archive is needed: LibTorch's writer does those.
  if (nbytes > 0xF0000000ull || pkl.size() > 0x1000000ull) {
    ArchiveWriter zip(sink);
    for (const Rec& r : records) zip.record(r.name, r.data, r.size);
    zip.finish();
    return;
  }
  SmallZipWriter zip(sink);
  for (const Rec& r : records) zip.add(r.name, r.data, r.size);
  zip.add("version", "3\n", 2);
  zip.finish();
}

pickle::NodePtr tensor_node(at::ScalarType dtype, const std::string& key, at::IntArrayRef sizes,
                            at::IntArrayRef strides, int64_t numel, const std::string& what) {
  using pickle::Node;
  std::vector<pickle::NodePtr> size, stride;
  for (int64_t v : sizes) size.push_back(Node::integer(v));
  for (int64_t v : strides) stride.push_back(Node::integer(v));
  pickle::NodePtr storage = Node::persistent_id(
      Node::tuple({Node::str("storage"), Node::global("torch", formats::storage_class(dtype, what)),
                   Node::str(key), Node::str("cpu"), Node::integer(numel)}));
  pickle::NodePtr hooks = Node::object(Node::global("collections", "OrderedDict"), {}, false);
  return Node::object(Node::global("torch._utils", "_rebuild_tensor_v2"),
                      {storage, Node::integer(0), Node::tuple(size), Node::tuple(stride),
                       Node::boolean(false), hooks},
                      false);
}

}  // namespace archive
}  // namespace checkpoint
}  // namespace fsdp
