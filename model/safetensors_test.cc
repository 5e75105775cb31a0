#include "model/safetensors.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/endian.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::model {
namespace {

using testing::HasSubstr;

std::string TempDir(const std::string& name) {
  const std::string d = absl::StrCat(testing::TempDir(), "/", name);
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

void WriteFile(const std::string& header, const std::string& data, const std::string& path) {
  std::ofstream f(path, std::ios::binary);
  uint8_t len[8];
  StoreLE<uint64_t>(len, header.size());
  f.write(reinterpret_cast<const char*>(len), 8);
  f << header << data;
}

TEST(SafetensorsTest, ReadsAFileWrittenByPythonsStandardLibrary) {
  // An independent writer: CPython's struct and json modules.
  const std::string dir = TempDir("st_python");
  const std::string script = absl::StrCat(STRATA_PYTHON, " -c '", R"(import json, struct, sys
a = struct.pack("<6f", 1, 2, 3, 4, 5, 6)
b = struct.pack("<3e", 0.5, -2, 65504)
h = {"__metadata__": {"format": "pt"}, "w.a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
     "w.b": {"dtype": "F16", "shape": [3], "data_offsets": [24, 30]}}
hb = json.dumps(h).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(hb)) + hb + a + b))",
                                          "' ", dir, "/model.safetensors");
  ASSERT_EQ(std::system(script.c_str()), 0);
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  absl::StatusOr<Checkpoint::Tensor> a = (*ck)->Get("w.a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->info->dtype, TensorDType::kF32);
  EXPECT_THAT(a->info->shape, testing::ElementsAre(2, 3));
  float values[6];
  std::memcpy(values, a->data.data(), 24);
  EXPECT_EQ(values[5], 6.0f);
  absl::StatusOr<Checkpoint::Tensor> b = (*ck)->Get("w.b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->info->dtype, TensorDType::kF16);
  EXPECT_EQ(LoadLE<uint16_t>(b->data.data() + 4), 0x7bff);  // 65504
  EXPECT_EQ((*ck)->Get("w.c").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT((*ck)->Names(), testing::ElementsAre("w.a", "w.b"));
}

TEST(SafetensorsTest, WrittenFilesReadBack) {
  const std::string dir = TempDir("st_write");
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 9.0f, 7.0f};
  const std::vector<int32_t> b = {42};
  const TensorToWrite t[] = {
      {"a",
       TensorDType::kF32,
       {2, 3},
       absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(a.data()), a.size() * 4)},
      {"b",
       TensorDType::kI32,
       {1},
       absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(b.data()), 4)},
  };
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", t).ok());
  auto ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  auto ta = (*ck)->Get("a");
  ASSERT_TRUE(ta.ok());
  float back[6];
  std::memcpy(back, ta->data.data(), 24);
  EXPECT_EQ(back[2], 3.25f);
  EXPECT_THAT(ta->info->shape, testing::ElementsAre(2, 3));
  const TensorToWrite wrong[] = {{"x", TensorDType::kF32, {4}, t[1].data}};
  EXPECT_EQ(WriteSafetensors(dir + "/bad.safetensors", wrong).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, ShardedCheckpointsFollowTheIndex) {
  const std::string dir = TempDir("st_sharded");
  WriteFile(R"({"x":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})", std::string(4, '\1'),
            dir + "/part-1.safetensors");
  WriteFile(R"({"y":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "ab",
            dir + "/part-2.safetensors");
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"metadata":{},"weight_map":{"x":"part-1.safetensors","y":"part-2.safetensors"}})";
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ((*ck)->Get("y")->data[1], 'b');
  EXPECT_EQ((*ck)->Get("x")->info->dtype, TensorDType::kI32);
  std::ofstream(dir + "/model.safetensors.index.json") << R"({"weight_map":{"x":"../etc/passwd"}})";
  EXPECT_THAT(std::string(Checkpoint::Open(dir).status().message()),
              HasSubstr("not a plain file name"));
}

TEST(SafetensorsTest, BadHeadersNameTheTensorAndTheProblem) {
  struct Case {
    const char* header;
    uint64_t data_bytes;
    const char* message;
  } cases[] = {
      {"not json", 0, "not valid JSON"},
      {"[1,2]", 0, "not a JSON object"},
      {R"({"t":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}})", 4,
       "tensor 't': unknown dtype 'F99'"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4, "4 bytes for 2 elements"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", 4,
       "outside the 4-byte data area"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 16, "outside"},
      {R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4, "not a size"},
      {R"({"t":{"dtype":"F32","shape":[1]}})", 4, "needs exactly dtype, shape and data_offsets"},
      {R"({"t":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,4]}})", 4,
       "shape too large"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       8, "'a' and 'b' overlap"},
      {R"({"__metadata__":{"k":1}})", 0, "not a string"},
      // A zero-size tensor between two overlapping ones must not hide the overlap.
      {R"({"a":{"dtype":"U8","shape":[100],"data_offsets":[0,100]},"b":{"dtype":"U8","shape":[0],"data_offsets":[10,10]},"c":{"dtype":"U8","shape":[10],"data_offsets":[50,60]}})",
       100, "'a' and 'c' overlap"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<TensorInfo>> r = ParseSafetensorsHeader(c.header, c.data_bytes);
    ASSERT_FALSE(r.ok()) << c.header;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.header;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.message)) << c.header;
  }
}

TEST(SafetensorsTest, TruncatedAndOversizedFilesAreRejected) {
  const std::string dir = TempDir("st_bad");
  const std::string path = dir + "/model.safetensors";
  std::ofstream(path) << "abc";
  EXPECT_THAT(std::string(SafetensorsFile::Open(path).status().message()), HasSubstr("too short"));
  WriteFile(R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, '\0'),
            path);  // data area shorter than the tensor
  EXPECT_THAT(std::string(SafetensorsFile::Open(path).status().message()),
              HasSubstr("outside the 8-byte data area"));
  {
    std::ofstream f(path, std::ios::binary);
    uint8_t len[8];
    StoreLE<uint64_t>(len, 1ull << 40);  // header length far past the file
    f.write(reinterpret_cast<const char*>(len), 8);
    f << "{}";
  }
  EXPECT_THAT(std::string(SafetensorsFile::Open(path).status().message()),
              HasSubstr("exceeds the file"));
  EXPECT_EQ(SafetensorsFile::Open(dir + "/missing.safetensors").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace strata::model
