// Declarations only (see io.h next to this file).
#ifndef LLMCHAT_SHIM_TVM_SUPPORT_SERIALIZER_H_
#define LLMCHAT_SHIM_TVM_SUPPORT_SERIALIZER_H_
#include <tvm/support/io.h>
namespace tvm {
namespace support {
template <typename T>
struct Serializer;
}  // namespace support
}  // namespace tvm
#endif
