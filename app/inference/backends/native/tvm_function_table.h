// TVM's serialized device-module function table, read by llmchat's add-ons (the WebGPU one and
// the HIP/CUDA-twin one): a u64 count, then per function its key, name, argument types (4-byte
// DLDataType each), launch parameter tags and extra argument tags, all length-prefixed.
// Every read is bounds-checked: a truncated or damaged table is an error, never a read past the end.
#ifndef LLMCHAT_TVM_FUNCTION_TABLE_H_
#define LLMCHAT_TVM_FUNCTION_TABLE_H_

#include <dlpack/dlpack.h>
#include <tvm/ffi/error.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace llmchat_native {

struct FunctionInfo {
  std::string name;
  std::vector<DLDataType> arg_types;
  std::vector<std::string> launch_tags;
  std::vector<int32_t> extra_tags;
};

class Reader {
 public:
  // ``what`` names the module in the error ("the library's WebGPU module")
  Reader(const char* data, size_t size, const char* what) : p_(data), end_(data + size), what_(what) {}
  uint64_t u64() {
    uint64_t v;
    need(8);
    memcpy(&v, p_, 8);
    p_ += 8;
    return v;
  }
  uint32_t u32() {
    uint32_t v;
    need(4);
    memcpy(&v, p_, 4);
    p_ += 4;
    return v;
  }
  std::string str() {
    uint64_t n = u64();
    need(n);
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  // a count of items of at least ``min_item`` bytes each, checked against what is left
  uint64_t count(size_t min_item) {
    uint64_t n = u64();
    if (min_item && n > static_cast<uint64_t>(end_ - p_) / min_item) fail();
    return n;
  }
  bool done() const { return p_ == end_; }

 private:
  void need(uint64_t n) {
    if (n > static_cast<uint64_t>(end_ - p_)) fail();
  }
  [[noreturn]] void fail() {
    TVM_FFI_THROW(RuntimeError) << what_ << " is damaged (truncated function table)";
    throw;  // not reached
  }
  const char* p_;
  const char* end_;
  const char* what_;
};

inline std::unordered_map<std::string, FunctionInfo> read_function_table(Reader& r) {
  std::unordered_map<std::string, FunctionInfo> fmap;
  uint64_t nf = r.count(8);
  for (uint64_t i = 0; i < nf; ++i) {
    std::string key = r.str();
    FunctionInfo info;
    info.name = r.str();
    uint64_t nt = r.count(4);
    for (uint64_t j = 0; j < nt; ++j) {
      uint32_t raw = r.u32();
      DLDataType t;
      memcpy(&t, &raw, 4);
      info.arg_types.push_back(t);
    }
    uint64_t ntag = r.count(8);
    for (uint64_t j = 0; j < ntag; ++j) info.launch_tags.push_back(r.str());
    uint64_t nextra = r.count(4);
    for (uint64_t j = 0; j < nextra; ++j) info.extra_tags.push_back(static_cast<int32_t>(r.u32()));
    fmap.emplace(key, std::move(info));
  }
  return fmap;
}

}  // namespace llmchat_native

#endif  // LLMCHAT_TVM_FUNCTION_TABLE_H_
