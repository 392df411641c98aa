// Internal: a restricted reader and a small writer of Python pickles, for the metadata of PyTorch
// DCP checkpoints (`.metadata` is a plain pickle of dataclasses; issue 11).
//
// Reading never executes anything: the pickle is decoded into a tree of Nodes. A class or
// function reference (GLOBAL / STACK_GLOBAL) must be on the caller's allowlist; calling it
// (REDUCE, NEWOBJ) and setting state (BUILD) only record the call and the state in an Object
// node for the caller to interpret. Every length, index and count is checked against the input
// and the limits before use, so a hostile file gives a PickleError naming the opcode and offset,
// never a crash, a hang or a large allocation.
//
// The writer emits protocol 2 with GLOBAL, NEWOBJ, REDUCE and BUILD: what stock PyTorch 2.6 and
// 2.14 were seen to load (tests/dcp). Classes and strings that recur are written once
// and fetched from the memo (BINPUT / BINGET), as Python's own pickler does.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/errors.h"

namespace fsdp {
namespace checkpoint {
namespace pickle {

/// A pickle that is malformed, exceeds a limit, or uses an opcode or global not allowed.
class PickleError : public ValueError {
 public:
  using ValueError::ValueError;
};

struct Node;
using NodePtr = std::shared_ptr<Node>;

/// One decoded value. Containers hold shared pointers, as the pickle's memo can share them.
struct Node {
  enum class Kind {
    NONE,
    BOOL,
    INT,
    FLOAT,
    STR,
    BYTES,
    TUPLE,
    LIST,
    DICT,
    GLOBAL,
    OBJECT,
    PERS_ID
  };
  Kind kind = Kind::NONE;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                                     // Str, Bytes
  std::string module, name;                          // Global
  std::vector<NodePtr> items;                        // Tuple, List; Object: the call's arguments
  std::vector<std::pair<NodePtr, NodePtr>> entries;  // Dict, in insertion order
  NodePtr callee;                                    // Object: the Global called
  bool newobj = false;                               // Object: made by NEWOBJ (else REDUCE)
  NodePtr state;                                     // Object: BUILD's argument, if any
                                                     // PersId: items[0] is the id

  Node() = default;
  Node(const Node&) = default;
  Node(Node&&) = default;
  Node& operator=(const Node&) = default;
  Node& operator=(Node&&) = default;
  /// Takes its descendants apart one at a time rather than recursively: a hostile pickle nests a
  /// list a million deep within every limit of the reader, and recursive destruction of such a
  /// tree overflows the stack.
  ~Node();

  static NodePtr none();
  static NodePtr boolean(bool v);
  static NodePtr integer(int64_t v);
  static NodePtr real(double v);
  static NodePtr str(std::string v);
  static NodePtr tuple(std::vector<NodePtr> v);
  static NodePtr list(std::vector<NodePtr> v);
  static NodePtr dict(std::vector<std::pair<NodePtr, NodePtr>> v);
  static NodePtr global(std::string module, std::string name);
  /// cls.__new__(cls, *args) then BUILD(state) when `newobj`; else cls(*args) (REDUCE).
  static NodePtr object(NodePtr callee, std::vector<NodePtr> args, bool newobj,
                        NodePtr state = nullptr);
  /// A persistent id (BINPERSID): how torch.save refers to a tensor storage stored beside the
  /// pickle, ('storage', <storage class>, key, location, numel).
  static NodePtr persistent_id(NodePtr id);

  bool is(Kind k) const { return kind == k; }
  /// "module.name" of a Global, or of an Object's callee; "" otherwise.
  std::string class_name() const;
  /// The Dict entry whose key is the string `key`, or null.
  NodePtr get(const std::string& key) const;
};

const char* to_string(Node::Kind k);

struct ReadLimits {
  /// Largest input accepted.
  size_t max_bytes = size_t{64} << 20;
  /// Most nodes created (each opcode creates at most one).
  size_t max_nodes = size_t{4} << 20;
  /// Deepest MARK nesting and stack size.
  size_t max_stack = size_t{1} << 20;
  /// Accept BINPERSID (torch.save archives' storages); DCP's `.metadata` has none.
  bool persistent_ids = false;
};

/// Decodes `data`. Globals must be in `allowed` as {module, name}. Throws PickleError.
NodePtr read(const std::string& data, const std::set<std::pair<std::string, std::string>>& allowed,
             const ReadLimits& limits = {});

/// Encodes `root` (protocol 2; Bytes are not supported by protocol 2 and throw). A structure
/// deeper than 256 levels (or cyclic) throws PickleError.
std::string write(const NodePtr& root);

}  // namespace pickle
}  // namespace checkpoint
}  // namespace fsdp
