// A stand-in for libcupti.so.13 with just the calls kernel_profile.cc makes, so selftest.sh can
// run the profiler's phase bookkeeping and report on a machine without a GPU. Records pushed
// with fake_push_* are handed to the profiler at the next cuptiActivityFlushAll, as CUPTI does.
#include <cupti.h>

#include <cstdlib>
#include <cstring>
#include <vector>

namespace {
CUpti_BuffersCallbackRequestFunc requested = nullptr;
CUpti_BuffersCallbackCompleteFunc completed = nullptr;
uint64_t now_ns = 0;
// Every record in a slot of the largest record's size, so iteration is one stride.
constexpr size_t kSlot = sizeof(CUpti_ActivityKernel10) > sizeof(CUpti_ActivityMemcpy6)
                             ? sizeof(CUpti_ActivityKernel10)
                             : sizeof(CUpti_ActivityMemcpy6);
std::vector<std::vector<uint8_t>> pending;
}  // namespace

extern "C" {
void fake_set_time(uint64_t ns) { now_ns = ns; }

void fake_push_kernel(const char* name, uint64_t start, uint64_t end) {
  std::vector<uint8_t> slot(kSlot, 0);
  auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(slot.data());
  k->kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
  k->name = strdup(name);
  k->start = start;
  k->end = end;
  pending.push_back(slot);
}

void fake_push_memcpy(uint8_t copy_kind, uint64_t bytes, uint64_t start, uint64_t end) {
  std::vector<uint8_t> slot(kSlot, 0);
  auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(slot.data());
  m->kind = CUPTI_ACTIVITY_KIND_MEMCPY;
  m->copyKind = copy_kind;
  m->bytes = bytes;
  m->start = start;
  m->end = end;
  pending.push_back(slot);
}

CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc req,
                                           CUpti_BuffersCallbackCompleteFunc comp) {
  requested = req;
  completed = comp;
  return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityEnable(CUpti_ActivityKind) { return CUPTI_SUCCESS; }

CUptiResult cuptiActivityFlushAll(uint32_t) {
  if (!requested || !completed || pending.empty()) return CUPTI_SUCCESS;
  uint8_t* buf = nullptr;
  size_t size = 0, max_records = 0;
  requested(&buf, &size, &max_records);
  size_t used = 0;
  for (auto& slot : pending) {
    if (used + kSlot > size) break;
    memcpy(buf + used, slot.data(), kSlot);
    used += kSlot;
  }
  pending.clear();
  completed(nullptr, 0, buf, size, used);
  return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityGetNextRecord(uint8_t* buffer, size_t valid, CUpti_Activity** record) {
  uint8_t* next = *record ? reinterpret_cast<uint8_t*>(*record) + kSlot : buffer;
  if (next + kSlot > buffer + valid) return CUPTI_ERROR_MAX_LIMIT_REACHED;
  *record = reinterpret_cast<CUpti_Activity*>(next);
  return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityGetNumDroppedRecords(CUcontext, uint32_t, size_t* dropped) {
  *dropped = 0;
  return CUPTI_SUCCESS;
}

CUptiResult cuptiGetTimestamp(uint64_t* timestamp) {
  *timestamp = now_ns;
  return CUPTI_SUCCESS;
}

CUptiResult cuptiGetCallbackName(CUpti_CallbackDomain, uint32_t, const char** name) {
  *name = "cuLaunchKernel";
  return CUPTI_SUCCESS;
}

CUptiResult cuptiGetResultString(CUptiResult, const char** str) {
  *str = "fake";
  return CUPTI_SUCCESS;
}
}
