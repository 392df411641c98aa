// The restricted pickle reader and the protocol-2 writer (see pickle.h). Opcodes follow Python's
// pickletools documentation; only those stock DCP metadata uses (protocols 2 to 5) are read.
#include "checkpoint/formats/pickle.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace pickle {

using detail::msg;
using detail::quote;

// ---------------------------------------------------------------------------------------------
// Nodes

namespace {
// Moves the children of `n` that nobody else holds into `out`, leaving `n` without children. A
// child still held elsewhere (the memo, another parent, a caller) keeps its own; dropping our
// reference to it destroys nothing.
void detach_children(Node& n, std::vector<NodePtr>& out) {
  auto take = [&](NodePtr& c) {
    if (c && c.use_count() == 1) out.push_back(std::move(c));
    c.reset();
  };
  for (auto& c : n.items) take(c);
  for (auto& [k, v] : n.entries) {
    take(k);
    take(v);
  }
  take(n.callee);
  take(n.state);
  n.items.clear();
  n.entries.clear();
}

NodePtr make(Node::Kind k) {
  auto n = std::make_shared<Node>();
  n->kind = k;
  return n;
}
}  // namespace

NodePtr Node::none() { return make(Kind::NONE); }
NodePtr Node::boolean(bool v) {
  auto n = make(Kind::BOOL);
  n->b = v;
  return n;
}
NodePtr Node::integer(int64_t v) {
  auto n = make(Kind::INT);
  n->i = v;
  return n;
}
NodePtr Node::real(double v) {
  auto n = make(Kind::FLOAT);
  n->f = v;
  return n;
}
Node::~Node() {
  std::vector<NodePtr> pending;
  detach_children(*this, pending);
  while (!pending.empty()) {
    NodePtr n = std::move(pending.back());
    pending.pop_back();
    detach_children(*n, pending);
  }  // each n goes here, childless: its own destructor has nothing left to recurse into
}

NodePtr Node::str(std::string v) {
  auto n = make(Kind::STR);
  n->s = std::move(v);
  return n;
}
NodePtr Node::tuple(std::vector<NodePtr> v) {
  auto n = make(Kind::TUPLE);
  n->items = std::move(v);
  return n;
}
NodePtr Node::list(std::vector<NodePtr> v) {
  auto n = make(Kind::LIST);
  n->items = std::move(v);
  return n;
}
NodePtr Node::dict(std::vector<std::pair<NodePtr, NodePtr>> v) {
  auto n = make(Kind::DICT);
  n->entries = std::move(v);
  return n;
}
NodePtr Node::global(std::string module, std::string name) {
  auto n = make(Kind::GLOBAL);
  n->module = std::move(module);
  n->name = std::move(name);
  return n;
}
NodePtr Node::object(NodePtr callee, std::vector<NodePtr> args, bool newobj, NodePtr state) {
  auto n = make(Kind::OBJECT);
  n->callee = std::move(callee);
  n->items = std::move(args);
  n->newobj = newobj;
  n->state = std::move(state);
  return n;
}

NodePtr Node::persistent_id(NodePtr id) {
  auto n = make(Kind::PERS_ID);
  n->items.push_back(std::move(id));
  return n;
}

std::string Node::class_name() const {
  if (kind == Kind::GLOBAL) return module + "." + name;
  if (kind == Kind::OBJECT && callee) return callee->class_name();
  return "";
}

NodePtr Node::get(const std::string& key) const {
  for (const auto& [k, v] : entries) {
    if (k->kind == Kind::STR && k->s == key) return v;
  }
  return nullptr;
}

const char* to_string(Node::Kind k) {
  switch (k) {
    case Node::Kind::NONE:
      return "None";
    case Node::Kind::BOOL:
      return "bool";
    case Node::Kind::INT:
      return "int";
    case Node::Kind::FLOAT:
      return "float";
    case Node::Kind::STR:
      return "str";
    case Node::Kind::BYTES:
      return "bytes";
    case Node::Kind::TUPLE:
      return "tuple";
    case Node::Kind::LIST:
      return "list";
    case Node::Kind::DICT:
      return "dict";
    case Node::Kind::GLOBAL:
      return "global";
    case Node::Kind::OBJECT:
      return "object";
    case Node::Kind::PERS_ID:
      return "persistent id";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Reading

namespace {

class Reader {
 public:
  Reader(const std::string& d, const std::set<std::pair<std::string, std::string>>& allowed,
         const ReadLimits& limits)
      : d_(d), allowed_(allowed), limits_(limits) {}

  NodePtr run() {
    if (d_.size() > limits_.max_bytes) {
      throw PickleError(
          msg("pickle: ", d_.size(), " bytes exceed the limit of ", limits_.max_bytes));
    }
    while (true) {
      if (pos_ >= d_.size()) fail_at(pos_, "ends without STOP");
      op_pos_ = pos_;
      op_ = static_cast<uint8_t>(d_[pos_++]);
      if (op_ == '.') break;
      step();
    }
    if (stack_.size() != 1 || !marks_.empty())
      fail(msg("STOP with ", stack_.size(), " values and ", marks_.size(),
               " marks on the stack (expected one value)"));
    return stack_.back();
  }

  // Python's pickles may contain themselves (`l = []; l.append(l)`, through the memo); no value
  // fsdp-cpp reads can, and a cycle of shared pointers would never be freed. Only APPEND(S),
  // SETITEM(S) and BUILD add a child to a node that already exists, so without them there is
  // none; with them, every node made is searched (those dropped from the stack too).
  void check_acyclic() {
    if (!mutated_) return;
    std::unordered_map<const Node*, uint8_t> state;  // absent: unseen; 1: on the path; 2: done
    struct Frame {
      const Node* node;
      std::vector<const Node*> children;
      size_t next = 0;
    };
    for (const auto& weak : created_) {
      const NodePtr start = weak.lock();
      if (!start || state.count(start.get())) continue;
      std::vector<Frame> path;
      path.push_back({start.get(), children_of(*start)});
      state[start.get()] = 1;
      while (!path.empty()) {
        Frame& f = path.back();
        if (f.next == f.children.size()) {
          state[f.node] = 2;
          path.pop_back();
          continue;
        }
        const Node* c = f.children[f.next++];
        auto it = state.find(c);
        if (it == state.end()) {
          state[c] = 1;
          path.push_back({c, children_of(*c)});
        } else if (it->second == 1) {
          fail_at(pos_, "a value contains itself (through the memo); fsdp-cpp reads no such value");
        }
      }
    }
  }

  // A value read through the memo may share a node many times over (`a = [x, x]; b = [a, a]`,
  // ...): 60 levels of that are 2^60 values to anything that walks the tree (a writer, a reader
  // that copies what it finds), from a few hundred bytes. The value's size counted as a tree (each
  // shared node as often as it is reached) must stay within max_nodes, as the nodes made do.
  void check_expansion(const NodePtr& root) const {
    if (!root) return;
    const size_t cap = limits_.max_nodes;
    std::unordered_map<const Node*, size_t> size;  // as a tree, capped at cap + 1
    struct Frame {
      const Node* node;
      std::vector<const Node*> children;
      size_t next = 0;
      size_t total = 1;
    };
    std::vector<Frame> path;
    path.push_back({root.get(), children_of(*root)});
    while (!path.empty()) {
      Frame& f = path.back();
      if (f.next < f.children.size()) {
        const Node* c = f.children[f.next];
        const auto it = size.find(c);
        if (it == size.end()) {
          path.push_back({c, children_of(*c)});  // acyclic (check_acyclic): this ends
          continue;
        }
        f.total = std::min(cap + 1, f.total + it->second);
        ++f.next;
        continue;
      }
      if (f.total > cap)
        fail(msg("the value counts more than ", cap,
                 " values as a tree (memo references repeat its parts); fsdp-cpp reads no such "
                 "value"));
      size[f.node] = f.total;
      path.pop_back();
    }
  }

  // After a failure: takes every node made apart, so that a cycle among them cannot outlive the
  // reader (nothing else holds them: the value is not returned).
  void break_cycles() {
    if (!mutated_) return;
    std::vector<NodePtr> graveyard;
    for (const auto& weak : created_) {
      if (const NodePtr n = weak.lock()) {
        for (auto& c : n->items) graveyard.push_back(std::move(c));
        for (auto& [k, v] : n->entries) {
          graveyard.push_back(std::move(k));
          graveyard.push_back(std::move(v));
        }
        graveyard.push_back(std::move(n->callee));
        graveyard.push_back(std::move(n->state));
        n->items.clear();
        n->entries.clear();
      }
    }
  }

 private:
  static std::vector<const Node*> children_of(const Node& n) {
    std::vector<const Node*> out;
    for (const auto& c : n.items) out.push_back(c.get());
    for (const auto& [k, v] : n.entries) {
      out.push_back(k.get());
      out.push_back(v.get());
    }
    if (n.callee) out.push_back(n.callee.get());
    if (n.state) out.push_back(n.state.get());
    out.erase(std::remove(out.begin(), out.end(), nullptr), out.end());
    return out;
  }
  [[noreturn]] void fail_at(size_t at, const std::string& what) const {
    throw PickleError(msg("pickle: ", what, " (offset ", at, ")"));
  }
  [[noreturn]] void fail(const std::string& what) const {
    char op[8];
    std::snprintf(op, sizeof op, "0x%02x", op_);
    throw PickleError(msg("pickle: ", what, " (opcode ", op, " at offset ", op_pos_, ")"));
  }
  std::string take(uint64_t n) {
    if (n > d_.size() - pos_) {
      fail(msg("a length of ", n, " runs past the end (", d_.size() - pos_, " bytes left)"));
    }
    std::string out = d_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  // A str's n bytes, which must be UTF-8 as Python's unpickler decodes them ('utf-8',
  // 'surrogatepass': encoded surrogates pass, nothing else that is not UTF-8 does). Accepting
  // what Python's dcp.load raises UnicodeDecodeError on would approve a checkpoint PyTorch cannot
  // read.
  std::string unicode(uint64_t n) {
    const size_t at = pos_;
    std::string s = take(n);
    const size_t bad = utf8_error_at(s);
    if (bad != std::string::npos) {
      char byte[8];
      std::snprintf(byte, sizeof byte, "0x%02x", static_cast<uint8_t>(s[bad]));
      fail_at(at, msg("a str that is not UTF-8 (byte ", byte, " at position ", bad, " of it)"));
    }
    return s;
  }
  // Where `s` stops being UTF-8 (RFC 3629, surrogates allowed), or npos.
  static size_t utf8_error_at(const std::string& s) {
    auto cont = [&](size_t i, uint8_t lo = 0x80, uint8_t hi = 0xbf) {
      return i < s.size() && static_cast<uint8_t>(s[i]) >= lo && static_cast<uint8_t>(s[i]) <= hi;
    };
    for (size_t i = 0; i < s.size();) {
      const uint8_t c = static_cast<uint8_t>(s[i]);
      size_t len = 0;
      if (c < 0x80) {
        len = 1;
      } else if (c >= 0xc2 && c <= 0xdf) {
        len = cont(i + 1) ? 2 : 0;
      } else if (c >= 0xe0 && c <= 0xef) {
        len = cont(i + 1, c == 0xe0 ? 0xa0 : 0x80) && cont(i + 2) ? 3 : 0;
      } else if (c >= 0xf0 && c <= 0xf4) {
        const uint8_t lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
        len = cont(i + 1, lo, hi) && cont(i + 2) && cont(i + 3) ? 4 : 0;
      }
      if (len == 0) return i;
      i += len;
    }
    return std::string::npos;
  }
  uint64_t le(int bytes) {
    const std::string b = take(bytes);
    uint64_t v = 0;
    for (int k = bytes - 1; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(b[k]);
    return v;
  }
  std::string line() {
    const size_t nl = d_.find('\n', pos_);
    if (nl == std::string::npos || nl - pos_ > 1024) fail("unterminated or overlong name");
    std::string out = d_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return out;
  }
  NodePtr counted(NodePtr n) {
    if (++nodes_ > limits_.max_nodes) fail(msg("more than ", limits_.max_nodes, " values"));
    created_.push_back(n);
    return n;
  }
  void push(NodePtr n) {
    if (stack_.size() >= limits_.max_stack) fail("stack deeper than the limit");
    stack_.push_back(std::move(n));
  }
  NodePtr pop() {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) fail("stack underflow");
    NodePtr n = std::move(stack_.back());
    stack_.pop_back();
    return n;
  }
  NodePtr& top() {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) fail("stack underflow");
    return stack_.back();
  }
  std::vector<NodePtr> pop_mark() {
    if (marks_.empty()) fail("no MARK to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<NodePtr> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  NodePtr& expect(NodePtr& n, Node::Kind k, const char* what) {
    if (!n || n->kind != k) fail(msg(what, " must be a ", to_string(k)));
    return n;
  }
  void set_item(Node& dict, NodePtr k, NodePtr v) {
    // Python would keep the last value; a file with a repeated key is malformed or hostile.
    if (k->kind == Node::Kind::STR || k->kind == Node::Kind::INT) {
      const std::string id = k->kind == Node::Kind::STR ? "s" + k->s : "i" + std::to_string(k->i);
      if (!keys_[&dict].insert(id).second) {
        fail(msg("duplicate dict key ",
                 k->kind == Node::Kind::STR ? msg(quote(k->s)) : std::to_string(k->i)));
      }
    }
    mutated_ = true;
    dict.entries.emplace_back(std::move(k), std::move(v));
  }
  void put_memo(uint64_t idx) {
    if (idx > limits_.max_nodes) fail(msg("memo index ", idx, " beyond the limit"));
    memo_[idx] = top();
  }
  void get_memo(uint64_t idx) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) fail(msg("memo index ", idx, " was never stored"));
    push(it->second);
  }
  NodePtr global(std::string module, std::string name) {
    if (!allowed_.count({module, name})) {
      fail(msg("global ", quote(module + "." + name), " is not allowed here"));
    }
    return counted(Node::global(std::move(module), std::move(name)));
  }
  NodePtr call(bool newobj) {
    NodePtr args = pop();
    NodePtr callee = pop();
    expect(args, Node::Kind::TUPLE, newobj ? "NEWOBJ's arguments" : "REDUCE's arguments");
    expect(callee, Node::Kind::GLOBAL, newobj ? "NEWOBJ's class" : "REDUCE's callable");
    // collections.OrderedDict() (what nn.Module.state_dict() returns) is read as a dict, so that
    // SETITEMS can fill it; its BUILD state (`_metadata`) is kept on the dict.
    if (callee->module == "collections" && callee->name == "OrderedDict" && args->items.empty())
      return counted(Node::dict({}));
    return counted(Node::object(callee, args->items, newobj));
  }

  // One opcode. Long by nature: the restricted machine's whole instruction set is this one switch,
  // each case a few checked lines, so that what the reader accepts can be audited in one place.
  void step() {
    switch (op_) {
      case 0x80: {  // PROTO
        const uint64_t v = le(1);
        if (v > 5) fail(msg("protocol ", v, " is not supported"));
        return;
      }
      case 0x95: {  // FRAME: a length prefix only
        const uint64_t n = le(8);
        if (n > d_.size() - pos_) fail("frame longer than the rest of the input");
        return;
      }
      case '(':
        marks_.push_back(stack_.size());
        if (marks_.size() > limits_.max_stack) fail("too many marks");
        return;
      case 'N':
        push(counted(Node::none()));
        return;
      case 0x88:
        push(counted(Node::boolean(true)));
        return;
      case 0x89:
        push(counted(Node::boolean(false)));
        return;
      case 'K':
        push(counted(Node::integer(static_cast<int64_t>(le(1)))));
        return;
      case 'M':
        push(counted(Node::integer(static_cast<int64_t>(le(2)))));
        return;
      case 'J':
        push(counted(Node::integer(static_cast<int32_t>(static_cast<uint32_t>(le(4))))));
        return;
      case 0x8a: {  // LONG1: little-endian two's complement of n bytes
        const uint64_t n = le(1);
        if (n > 8) fail(msg("integer of ", n, " bytes does not fit 64 bits"));
        uint64_t v = n ? le(static_cast<int>(n)) : 0;
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign
        push(counted(Node::integer(static_cast<int64_t>(v))));
        return;
      }
      case 'G': {  // BINFLOAT: big-endian double
        const std::string b = take(8);
        uint64_t bits = 0;
        for (char c : b) bits = (bits << 8) | static_cast<uint8_t>(c);
        double v;
        std::memcpy(&v, &bits, sizeof v);
        push(counted(Node::real(v)));
        return;
      }
      case 0x8c:
        push(counted(Node::str(unicode(le(1)))));
        return;  // SHORT_BINUNICODE
      case 'X':
        push(counted(Node::str(unicode(le(4)))));
        return;  // BINUNICODE
      case 0x8d:
        push(counted(Node::str(unicode(le(8)))));
        return;     // BINUNICODE8
      case 'C':     // SHORT_BINBYTES
      case 'B':     // BINBYTES
      case 0x8e: {  // BINBYTES8
        NodePtr n = Node::str(take(le(op_ == 'C' ? 1 : op_ == 'B' ? 4 : 8)));
        n->kind = Node::Kind::BYTES;
        push(counted(n));
        return;
      }
      case ')':
        push(counted(Node::tuple({})));
        return;
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        const size_t n = op_ - 0x84;
        std::vector<NodePtr> items(n);
        for (size_t k = n; k-- > 0;) items[k] = pop();
        push(counted(Node::tuple(std::move(items))));
        return;
      }
      case 't':
        push(counted(Node::tuple(pop_mark())));
        return;
      case ']':
        push(counted(Node::list({})));
        return;
      case 'l':
        push(counted(Node::list(pop_mark())));
        return;
      case 'a': {  // APPEND
        NodePtr v = pop();
        mutated_ = true;
        expect(top(), Node::Kind::LIST, "APPEND's target").get()->items.push_back(std::move(v));
        return;
      }
      case 'e': {  // APPENDS
        std::vector<NodePtr> items = pop_mark();
        mutated_ = true;
        auto& l = expect(top(), Node::Kind::LIST, "APPENDS' target")->items;
        l.insert(l.end(), items.begin(), items.end());
        return;
      }
      case '}':
        push(counted(Node::dict({})));
        return;
      case 'd': {  // DICT
        std::vector<NodePtr> items = pop_mark();
        if (items.size() % 2) fail("DICT with an odd number of items");
        NodePtr d = counted(Node::dict({}));
        for (size_t k = 0; k < items.size(); k += 2) set_item(*d, items[k], items[k + 1]);
        push(d);
        return;
      }
      case 's': {  // SETITEM
        NodePtr v = pop();
        NodePtr k = pop();
        set_item(*expect(top(), Node::Kind::DICT, "SETITEM's target"), k, v);
        return;
      }
      case 'u': {  // SETITEMS
        std::vector<NodePtr> items = pop_mark();
        if (items.size() % 2) fail("SETITEMS with an odd number of items");
        Node& d = *expect(top(), Node::Kind::DICT, "SETITEMS' target");
        for (size_t k = 0; k < items.size(); k += 2) set_item(d, items[k], items[k + 1]);
        return;
      }
      case 'c': {  // GLOBAL "module\nname\n"
        std::string module = line();
        std::string name = line();
        push(global(std::move(module), std::move(name)));
        return;
      }
      case 0x93: {  // STACK_GLOBAL
        NodePtr name = pop();
        NodePtr module = pop();
        expect(name, Node::Kind::STR, "STACK_GLOBAL's name");
        expect(module, Node::Kind::STR, "STACK_GLOBAL's module");
        push(global(module->s, name->s));
        return;
      }
      case 'R':
        push(call(false));
        return;
      case 0x81:
        push(call(true));
        return;
      case 'b': {  // BUILD
        NodePtr state = pop();
        if (top()->kind != Node::Kind::DICT) expect(top(), Node::Kind::OBJECT, "BUILD's target");
        Node& obj = *top();
        if (obj.state) fail("BUILD applied twice to one object");
        mutated_ = true;
        obj.state = std::move(state);
        return;
      }
      case 0x94:
        put_memo(memo_.size());
        return;    // MEMOIZE
      case 'Q': {  // BINPERSID
        if (!limits_.persistent_ids) fail("persistent ids are not allowed here");
        push(Node::persistent_id(pop()));
        return;
      }
      case 'q':
        put_memo(le(1));
        return;  // BINPUT
      case 'r':
        put_memo(le(4));
        return;  // LONG_BINPUT
      case 'h':
        get_memo(le(1));
        return;  // BINGET
      case 'j':
        get_memo(le(4));
        return;  // LONG_BINGET
      default:
        fail("opcode not supported by this reader");
    }
  }

  const std::string& d_;
  const std::set<std::pair<std::string, std::string>>& allowed_;
  const ReadLimits& limits_;
  size_t pos_ = 0, op_pos_ = 0, nodes_ = 0;
  uint8_t op_ = 0;
  std::vector<NodePtr> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, NodePtr> memo_;
  std::unordered_map<const Node*, std::unordered_set<std::string>> keys_;  // per dict
  std::vector<std::weak_ptr<Node>> created_;  // every node made (check_acyclic, break_cycles)
  bool mutated_ = false;                      // a node got a child after it was made
};

// ---------------------------------------------------------------------------------------------
// Writing

class Writer {
 public:
  std::string run(const NodePtr& root) {
    out_ += "\x80\x02";
    emit(root, 0);
    out_ += '.';
    return out_;
  }

 private:
  void u32(uint32_t v) {
    for (int k = 0; k < 4; ++k) out_ += static_cast<char>((v >> (8 * k)) & 0xff);
  }
  // One node. Long by nature: one case per kind of value the writer can emit, each the few opcodes
  // that value takes, kept together as the mirror of the reader's switch.
  void emit(const NodePtr& n, int depth) {
    if (!n) throw PickleError("pickle write: null node");
    if (depth > 256) throw PickleError("pickle write: deeper than 256 levels (cyclic?)");
    switch (n->kind) {
      case Node::Kind::NONE:
        out_ += 'N';
        return;
      case Node::Kind::BOOL:
        out_ += n->b ? '\x88' : '\x89';
        return;
      case Node::Kind::INT:
        return integer(n->i);
      case Node::Kind::FLOAT: {
        uint64_t bits;
        std::memcpy(&bits, &n->f, sizeof bits);
        out_ += 'G';
        for (int k = 7; k >= 0; --k) out_ += static_cast<char>((bits >> (8 * k)) & 0xff);
        return;
      }
      case Node::Kind::STR:
        if (n->s.size() > 0xffffffffu) throw PickleError("pickle write: string too long");
        if (recall('s' + n->s)) return;
        out_ += 'X';
        u32(static_cast<uint32_t>(n->s.size()));
        out_ += n->s;
        remember();
        return;
      case Node::Kind::BYTES:
        throw PickleError("pickle write: bytes need protocol 3, this writer emits protocol 2");
      case Node::Kind::TUPLE:
        if (n->items.empty()) {
          out_ += ')';
        } else if (n->items.size() <= 3) {
          for (const auto& x : n->items) emit(x, depth + 1);
          out_ += static_cast<char>(0x84 + n->items.size());
        } else {
          out_ += '(';
          for (const auto& x : n->items) emit(x, depth + 1);
          out_ += 't';
        }
        return;
      case Node::Kind::LIST:
        out_ += ']';
        if (!n->items.empty()) {
          out_ += '(';
          for (const auto& x : n->items) emit(x, depth + 1);
          out_ += 'e';
        }
        return;
      case Node::Kind::DICT:
        out_ += '}';
        if (!n->entries.empty()) {
          out_ += '(';
          for (const auto& [k, v] : n->entries) {
            emit(k, depth + 1);
            emit(v, depth + 1);
          }
          out_ += 'u';
        }
        return;
      case Node::Kind::GLOBAL:
        if (n->module.find('\n') != std::string::npos || n->name.find('\n') != std::string::npos)
          throw PickleError("pickle write: newline in a global's name");
        if (recall('g' + n->module + '\n' + n->name)) return;
        out_ += 'c' + n->module + '\n' + n->name + '\n';
        remember();
        return;
      case Node::Kind::PERS_ID:
        if (n->items.size() != 1)
          throw PickleError("pickle write: a persistent id holds one value");
        emit(n->items[0], depth + 1);
        out_ += 'Q';
        return;
      case Node::Kind::OBJECT:
        if (!n->callee || n->callee->kind != Node::Kind::GLOBAL)
          throw PickleError("pickle write: an object's callee must be a global");
        emit(n->callee, depth + 1);
        emit(Node::tuple(n->items), depth + 1);
        out_ += n->newobj ? '\x81' : 'R';
        if (n->state) {
          emit(n->state, depth + 1);
          out_ += 'b';
        }
        return;
    }
  }
  void integer(int64_t v) {
    if (v >= 0 && v < 0x100) {
      out_ += 'K';
      out_ += static_cast<char>(v);
    } else if (v >= 0 && v < 0x10000) {
      out_ += 'M';
      out_ += static_cast<char>(v & 0xff);
      out_ += static_cast<char>(v >> 8);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';
      u32(static_cast<uint32_t>(static_cast<int32_t>(v)));
    } else {  // LONG1, 8 bytes of two's complement
      out_ += '\x8a';
      out_ += '\x08';
      const auto u = static_cast<uint64_t>(v);
      for (int k = 0; k < 8; ++k) out_ += static_cast<char>((u >> (8 * k)) & 0xff);
    }
  }
  // The memo, as Python's pickler keeps it: a class or a string written once and fetched again by
  // index (BINGET, 2 bytes) wherever it recurs. A DCP `.metadata` names the same few dataclasses
  // and field names for every chunk and storage entry; without the memo they were most of its
  // bytes. Strings are immutable in Python, so sharing equal ones changes nothing for a reader.
  bool recall(std::string key) {
    auto [it, fresh] = memo_.emplace(std::move(key), static_cast<uint32_t>(memo_.size()));
    if (fresh) {
      pending_ = it->second;
      return false;
    }
    if (it->second < 0x100) {
      out_ += 'h';  // BINGET
      out_ += static_cast<char>(it->second);
    } else {
      out_ += 'j';  // LONG_BINGET
      u32(it->second);
    }
    return true;
  }
  void remember() {  // stores what was just pushed at the index recall() gave it
    if (pending_ < 0x100) {
      out_ += 'q';  // BINPUT
      out_ += static_cast<char>(pending_);
    } else {
      out_ += 'r';  // LONG_BINPUT
      u32(pending_);
    }
  }
  std::string out_;
  std::unordered_map<std::string, uint32_t> memo_;
  uint32_t pending_ = 0;
};

}  // namespace

NodePtr read(const std::string& data, const std::set<std::pair<std::string, std::string>>& allowed,
             const ReadLimits& limits) {
  Reader reader(data, allowed, limits);
  try {
    NodePtr root = reader.run();
    reader.check_acyclic();
    reader.check_expansion(root);
    return root;
  } catch (...) {
    reader.break_cycles();
    throw;
  }
}

std::string write(const NodePtr& root) { return Writer().run(root); }

}  // namespace pickle
}  // namespace checkpoint
}  // namespace fsdp
