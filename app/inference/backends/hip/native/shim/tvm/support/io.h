// Declarations only: the apache-tvm wheel ships tvm/runtime/vm/vm.h (whose VM extension API the
// CUDA twin uses) but not the serialization headers it includes.  Nothing here is called by
// llmchat's runtime; the inline (de)serialisers of tensor.h only need these names to compile.
#ifndef LLMCHAT_SHIM_TVM_SUPPORT_IO_H_
#define LLMCHAT_SHIM_TVM_SUPPORT_IO_H_
#include <cstddef>
namespace tvm {
namespace support {
class Stream {
 public:
  virtual ~Stream() {}
  virtual size_t Read(void* ptr, size_t size) = 0;
  virtual size_t Write(const void* ptr, size_t size) = 0;
  template <typename T>
  void Write(const T& data);
  template <typename T>
  bool Read(T* out);
  template <typename T>
  void WriteArray(const T* data, size_t num_elems);
  template <typename T>
  bool ReadArray(T* data, size_t num_elems);
};
}  // namespace support
}  // namespace tvm
#endif
