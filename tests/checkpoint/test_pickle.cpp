// The restricted pickle reader and the writer (src/checkpoint/formats/pickle.h), on their own:
// bytes Python's own pickler wrote decode to the values Python pickled, at protocols 2 and 4;
// the memo shares nodes; globals outside the allowlist, unknown opcodes and every truncation are
// refused with a PickleError that names the opcode and offset; what the writer writes reads
// back, and Python reads it to the same value (a container written twice reads as two equal ones).
// (The `.metadata` built on this reader, and its limits against hostile nesting, are
// test_dcp_metadata's.)
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "checkpoint/formats/pickle.h"
#include "multi_rank.h"

namespace pk = fsdp::checkpoint::pickle;

namespace {

std::string unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  }
  return out;
}

// Python 3.11's pickle.dumps(obj, protocol=P) of
//   shared = [1, 2]
//   obj = {'a': 1, 'b': [1.5, None, True, False], 'c': ('x', -7, 2**40), 'd': shared,
//          'e': shared, 'f': 'é'}
const char* kProto2 =
    "80027d71002858010000006171014b0158010000006271025d710328473ff80000000000004e888965580100000063"
    "710458010000007871054af9ffffff8a0600000000000187710658010000006471075d7108284b014b0265580100"
    "00006571096808580100000066710a5802000000c3a9710b752e";
const char* kProto4 =
    "80049551000000000000007d94288c0161944b018c0162945d9428473ff80000000000004e8889658c0163948c01"
    "78944af9ffffff8a0600000000000187948c0164945d94284b014b02658c01659468088c0166948c02c3a99475"
    "2e";
// pickle.dumps(collections.OrderedDict([('k', 1)]), protocol=2)
const char* kOrderedDict =
    "800263636f6c6c656374696f6e730a4f726465726564446963740a71002952710158010000006b71024b01732e";

// `shared`: the two keys that name one list in Python name one node (the reader keeps the memo's
// sharing; the writer writes a shared container twice, which Python reads as two equal lists).
void expect_python_value(const pk::NodePtr& root, bool shared = true) {
  ASSERT_TRUE(root->is(pk::Node::Kind::DICT));
  ASSERT_EQ(root->entries.size(), 6u);
  EXPECT_EQ(root->get("a")->i, 1);
  const pk::NodePtr b = root->get("b");
  ASSERT_TRUE(b->is(pk::Node::Kind::LIST));
  ASSERT_EQ(b->items.size(), 4u);
  EXPECT_EQ(b->items[0]->f, 1.5);
  EXPECT_TRUE(b->items[1]->is(pk::Node::Kind::NONE));
  EXPECT_TRUE(b->items[2]->is(pk::Node::Kind::BOOL) && b->items[2]->b);
  EXPECT_TRUE(b->items[3]->is(pk::Node::Kind::BOOL) && !b->items[3]->b);
  const pk::NodePtr c = root->get("c");
  ASSERT_TRUE(c->is(pk::Node::Kind::TUPLE));
  ASSERT_EQ(c->items.size(), 3u);
  EXPECT_EQ(c->items[0]->s, "x");
  EXPECT_EQ(c->items[1]->i, -7);
  EXPECT_EQ(c->items[2]->i, int64_t{1} << 40);
  // The memo: one list, reached under two keys, is one node.
  if (shared) {
    EXPECT_EQ(root->get("d").get(), root->get("e").get());
  }
  EXPECT_EQ(root->get("d")->items[1]->i, 2);
  EXPECT_EQ(root->get("f")->s, "\xc3\xa9");  // UTF-8, as Python encodes str
  // Keys keep Python's insertion order.
  std::string order;
  for (const auto& [k, v] : root->entries) order += k->s;
  EXPECT_EQ(order, "abcdef");
}

}  // namespace

TEST(PickleReader, DecodesWhatPythonsPicklerWroteAtProtocols2And4) {
  expect_python_value(pk::read(unhex(kProto2), {}));
  expect_python_value(pk::read(unhex(kProto4), {}));
}

TEST(PickleReader, AGlobalIsReadOnlyFromTheAllowlistAndNeverCalled) {
  // mymod.Point(1, 2), by REDUCE: recorded as an Object whose callee is the global, not called.
  const std::string point = std::string("\x80\x02") + "cmymod\nPoint\n" + "K\x01K\x02\x86" + "R.";
  const pk::NodePtr p = pk::read(point, {{"mymod", "Point"}});
  ASSERT_TRUE(p->is(pk::Node::Kind::OBJECT));
  EXPECT_EQ(p->class_name(), "mymod.Point");
  EXPECT_FALSE(p->newobj);
  ASSERT_EQ(p->items.size(), 2u);
  EXPECT_EQ(p->items[1]->i, 2);
  // collections.OrderedDict() (what a module's state_dict() is) reads as a dict SETITEMS fills.
  const std::string bytes = unhex(kOrderedDict);
  const pk::NodePtr od = pk::read(bytes, {{"collections", "OrderedDict"}});
  ASSERT_TRUE(od->is(pk::Node::Kind::DICT));
  ASSERT_NE(od->get("k"), nullptr);
  EXPECT_EQ(od->get("k")->i, 1);
  for (const std::string& refused : {bytes, point}) {
    try {
      pk::read(refused, {{"collections", "defaultdict"}});
      FAIL() << "a global outside the allowlist was read";
    } catch (const pk::PickleError& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find("collections.OrderedDict") != std::string::npos ||
                  what.find("mymod.Point") != std::string::npos)
          << what;
      EXPECT_NE(what.find("not allowed"), std::string::npos) << what;
    }
  }
}

TEST(PickleReader, EveryTruncationIsRefusedWithItsOffset) {
  const std::string bytes = unhex(kProto2);
  for (size_t n = 0; n < bytes.size(); ++n) {
    try {
      pk::read(bytes.substr(0, n), {});
      ADD_FAILURE() << "a pickle cut to " << n << " of " << bytes.size() << " bytes was read";
    } catch (const pk::PickleError& e) {
      EXPECT_NE(std::string(e.what()).find("offset"), std::string::npos) << n << ": " << e.what();
    }
  }
  EXPECT_NO_THROW(pk::read(bytes, {}));  // the whole of it is fine: the cuts are what fail
}

TEST(PickleReader, AnUnknownOpcodeIsNamedWithItsOffset) {
  std::string bytes = unhex(kProto2);
  const size_t at = bytes.find('K');  // the first BININT1, the value of 'a'
  ASSERT_NE(at, std::string::npos);
  bytes[at] = '\xff';
  try {
    pk::read(bytes, {});
    FAIL() << "opcode 0xff was read";
  } catch (const pk::PickleError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("not supported"), std::string::npos) << what;
    EXPECT_NE(what.find("offset " + std::to_string(at)), std::string::npos) << what;
  }
  // Protocol 6 does not exist yet: refused up front, not guessed at.
  std::string future = unhex(kProto2);
  future[1] = 6;
  EXPECT_THROW(pk::read(future, {}), pk::PickleError);
}

TEST(PickleWriter, WhatItWritesReadsBackAndPythonReadsTheSameValue) {
  const pk::NodePtr shared = pk::Node::list({pk::Node::integer(1), pk::Node::integer(2)});
  const pk::NodePtr tree = pk::Node::dict({
      {pk::Node::str("a"), pk::Node::integer(1)},
      {pk::Node::str("b"), pk::Node::list({pk::Node::real(1.5), pk::Node::none(),
                                           pk::Node::boolean(true), pk::Node::boolean(false)})},
      {pk::Node::str("c"), pk::Node::tuple({pk::Node::str("x"), pk::Node::integer(-7),
                                            pk::Node::integer(int64_t{1} << 40)})},
      {pk::Node::str("d"), shared},
      {pk::Node::str("e"), shared},
      {pk::Node::str("f"), pk::Node::str("\xc3\xa9")},
  });
  const std::string bytes = pk::write(tree);
  expect_python_value(pk::read(bytes, {}), /*shared=*/false);

  // Python's own unpickler: the same value as the one Python pickled above.
  fsdp::testing::TempDir dir;
  const std::string path = dir.path() + "/ours.pkl";
  std::ofstream(path, std::ios::binary) << bytes;
  const std::string cmd =
      "/usr/bin/python3 -c \"import pickle,sys; v = pickle.load(open(sys.argv[1], 'rb')); "
      "s = [1, 2]; ok = v == {'a': 1, 'b': [1.5, None, True, False], 'c': ('x', -7, 2**40), "
      "'d': s, 'e': s, 'f': '\\u00e9'}; print('same' if ok else v)\" " +
      path + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[256];
  while (fgets(buf, sizeof buf, p)) out += buf;
  const int rc = pclose(p);
  if (rc != 0 && out.find("No such file") != std::string::npos) GTEST_SKIP() << "no python3";
  EXPECT_EQ(out, "same\n");
}

TEST(PickleWriter, RefusesWhatProtocol2CannotSayAndCycles) {
  EXPECT_THROW(pk::write(nullptr), pk::PickleError);
  pk::NodePtr deep = pk::Node::none();
  for (int i = 0; i < 300; ++i) deep = pk::Node::list({deep});
  EXPECT_THROW(pk::write(deep), pk::PickleError);
  pk::NodePtr shallow = pk::Node::none();
  for (int i = 0; i < 200; ++i) shallow = pk::Node::list({shallow});
  EXPECT_NO_THROW(pk::read(pk::write(shallow), {}));  // the control: depth, not lists, refused
}
