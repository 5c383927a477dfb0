// Where a CUDA process's GPU time goes, kernel by kernel and phase by phase: a CUPTI
// injection library (the mechanism Nsight Systems uses), for the lent GPU machines, which have
// no profiler installed. Loaded by the CUDA driver at cuInit through
//     CUDA_INJECTION64_PATH=/path/libkernel_profile.so composer-rl bench model ...
// it records every kernel, memcpy, memset and driver-API call with CUPTI's activity API.
//
// Phases: the process calls `composer_profile_phase("label")` (found with dlopen(RTLD_NOLOAD)
// by `composer_model::bench::profile_phase`) right after synchronising the device; the
// records so far are flushed into the phase that ends and later ones count for the new one.
// At each mark and at exit the report (per phase: wall time, GPU kernel time, kernel launches;
// the kernels by total time; memcpy/memset; driver calls by total host time) is written to
// $COMPOSER_CUPTI_OUT (default ./cupti_profile.txt).
//
// Build (tools/gpu_prepare.sh does): g++ -O2 -shared -fPIC -I<cupti include> -I<cuda include>
//   kernel_profile.cc -L<cupti lib> -l:libcupti.so.13 -static-libstdc++ -static-libgcc
//   -Wl,--exclude-libs,ALL   (only InitializeInjection and composer_profile_phase exported)
#include <cuda.h>
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Sum {
  uint64_t count = 0;
  uint64_t ns = 0;
  uint64_t bytes = 0;
};

struct Phase {
  std::string label;
  uint64_t begin_ns = 0;  // CUPTI timestamp at the mark that opened it
  uint64_t end_ns = 0;    // at the next mark (0 while open)
  std::map<std::string, Sum> kernels;
  std::map<std::string, Sum> copies;  // memcpy by direction, memset
  std::map<std::string, Sum> driver;  // driver-API calls, host time
};

Phase named(const char* label, uint64_t begin_ns) {
  Phase p;
  p.label = label ? label : "?";
  p.begin_ns = begin_ns;
  return p;
}

std::mutex mu;
std::vector<Phase> phases;
uint64_t dropped = 0;
const char* out_path() {
  const char* p = getenv("COMPOSER_CUPTI_OUT");
  return p && *p ? p : "cupti_profile.txt";
}

std::string readable(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : name;
  free(d);
  // Template arguments make cuBLAS/CUTLASS names pages long: keep the head.
  if (s.size() > 110) s = s.substr(0, 107) + "...";
  return s;
}

const char* copy_kind(uint8_t k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "memcpy DtoD";
    default: return "memcpy other";
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = 8 << 20;
  *buffer = static_cast<uint8_t*>(aligned_alloc(8, *size));
  *max_records = 0;
}

// Called by CUPTI (its own thread, or the flushing one) with a full or flushed buffer.
void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(mu);
  if (phases.empty()) phases.push_back(named("start", 0));
  Phase& ph = phases.back();
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(rec);
        Sum& s = ph.kernels[readable(k->name)];
        s.count++;
        s.ns += k->end - k->start;
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(rec);
        Sum& s = ph.copies[copy_kind(m->copyKind)];
        s.count++;
        s.ns += m->end - m->start;
        s.bytes += m->bytes;
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(rec);
        Sum& s = ph.copies["memset"];
        s.count++;
        s.ns += m->end - m->start;
        s.bytes += m->bytes;
        break;
      }
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        auto* a = reinterpret_cast<CUpti_ActivityAPI*>(rec);
        const char* name = nullptr;
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name);
        Sum& s = ph.driver[name ? name : "?"];
        s.count++;
        s.ns += a->end - a->start;
        break;
      }
      default:
        break;
    }
  }
  size_t n = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &n);
  dropped += n;
  free(buffer);
}

template <class M>
std::vector<std::pair<std::string, Sum>> by_time(const M& m) {
  std::vector<std::pair<std::string, Sum>> v(m.begin(), m.end());
  std::sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.second.ns > b.second.ns; });
  return v;
}

void write_report() {
  std::lock_guard<std::mutex> lock(mu);
  FILE* f = fopen(out_path(), "w");
  if (!f) return;
  fprintf(f, "# CUPTI kernel profile (tools/cupti_profile); dropped records: %llu\n",
          (unsigned long long)dropped);
  for (const Phase& ph : phases) {
    uint64_t kernel_ns = 0, launches = 0;
    for (auto& [_, s] : ph.kernels) kernel_ns += s.ns, launches += s.count;
    const double wall_ms = ph.end_ns > ph.begin_ns && ph.begin_ns ? (ph.end_ns - ph.begin_ns) / 1e6 : 0;
    fprintf(f, "\n## phase %s: wall %.3f ms, kernel time %.3f ms (%.1f%% of wall), %llu launches\n",
            ph.label.c_str(), wall_ms, kernel_ns / 1e6,
            wall_ms > 0 ? 100.0 * kernel_ns / 1e6 / wall_ms : 0.0, (unsigned long long)launches);
    fprintf(f, "%10s %8s %10s %6s  %s\n", "total_ms", "count", "mean_us", "%kern", "kernel");
    int shown = 0;
    for (auto& [name, s] : by_time(ph.kernels)) {
      if (shown++ == 40) break;
      fprintf(f, "%10.3f %8llu %10.2f %6.1f  %s\n", s.ns / 1e6, (unsigned long long)s.count,
              s.ns / 1e3 / s.count, kernel_ns ? 100.0 * s.ns / kernel_ns : 0.0, name.c_str());
    }
    for (auto& [name, s] : by_time(ph.copies))
      fprintf(f, "%10.3f %8llu %10.2f %6s  %s (%.1f MB)\n", s.ns / 1e6,
              (unsigned long long)s.count, s.ns / 1e3 / s.count, "-", name.c_str(), s.bytes / 1e6);
    fprintf(f, "driver calls by host time:\n");
    shown = 0;
    for (auto& [name, s] : by_time(ph.driver)) {
      if (shown++ == 12) break;
      fprintf(f, "%10.3f %8llu %10.2f %6s  %s\n", s.ns / 1e6, (unsigned long long)s.count,
              s.ns / 1e3 / s.count, "-", name.c_str());
    }
  }
  fclose(f);
}

void at_exit() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  uint64_t now = 0;
  cuptiGetTimestamp(&now);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!phases.empty() && phases.back().end_ns == 0) phases.back().end_ns = now;
  }
  write_report();
}

}  // namespace

// Closes the open phase (after flushing its records) and opens `label`. Call it right after
// synchronising the device, so every kernel launched before belongs to the closed phase.
extern "C" void composer_profile_phase(const char* label) {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  uint64_t now = 0;
  cuptiGetTimestamp(&now);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (phases.empty()) phases.push_back(named("start", 0));
    phases.back().end_ns = now;
    phases.push_back(named(label, now));
  }
  write_report();
}

// The CUDA driver calls this once, at cuInit, when CUDA_INJECTION64_PATH names this library.
extern "C" int InitializeInjection(void) {
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) {
    fprintf(stderr, "cupti_profile: cuptiActivityRegisterCallbacks failed\n");
    return 0;
  }
  const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                      CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
                                      CUPTI_ACTIVITY_KIND_DRIVER};
  for (CUpti_ActivityKind k : kinds) {
    CUptiResult r = cuptiActivityEnable(k);
    if (r != CUPTI_SUCCESS) {
      const char* msg = nullptr;
      cuptiGetResultString(r, &msg);
      fprintf(stderr, "cupti_profile: enabling activity kind %d failed: %s\n", (int)k,
              msg ? msg : "?");
    }
  }
  atexit(at_exit);
  fprintf(stderr, "cupti_profile: recording kernels into %s\n", out_path());
  return 1;
}
