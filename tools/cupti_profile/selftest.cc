// Drives kernel_profile.cc against fake_cupti.cc (selftest.sh): two phases of made-up records,
// then checks the report's phase lines and kernel totals.
#include <cupti.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

extern "C" {
void fake_set_time(uint64_t ns);
void fake_push_kernel(const char* name, uint64_t start, uint64_t end);
void fake_push_memcpy(uint8_t copy_kind, uint64_t bytes, uint64_t start, uint64_t end);
}

int main(int argc, char** argv) {
  if (argc != 3) { fprintf(stderr, "usage: selftest PROFILER_SO REPORT\n"); return 2; }
  setenv("COMPOSER_CUPTI_OUT", argv[2], 1);
  void* h = dlopen(argv[1], RTLD_NOW);
  if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
  auto init = reinterpret_cast<int (*)()>(dlsym(h, "InitializeInjection"));
  auto phase = reinterpret_cast<void (*)(const char*)>(dlsym(h, "composer_profile_phase"));
  if (!init || !phase || init() != 1) { fprintf(stderr, "symbols or init failed\n"); return 1; }
  fake_push_kernel("warmup", 10, 20);                 // before the first mark: phase "start"
  fake_set_time(1000);
  phase("train: backward");
  fake_push_kernel("badd_bf16", 1100, 1400);          // 300 ns
  fake_push_kernel("badd_bf16", 1500, 1600);          // 100 ns
  fake_push_kernel("_Z6kernelIfEvPT_", 1600, 2600);   // demangled: void kernel<float>(float*)
  fake_push_memcpy(CUPTI_ACTIVITY_MEMCPY_KIND_HTOD, 4096, 1000, 1050);
  fake_set_time(3000);
  phase("after");
  std::ifstream in(argv[2]);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string r = ss.str();
  const char* want[] = {
      "## phase start:",
      "## phase train: backward: wall 0.002 ms, kernel time 0.001 ms (70.0% of wall), 3 launches",
      "     0.000        2       0.20   28.6  badd_bf16",
      "     0.001        1       1.00   71.4  void kernel<float>(float*)",
      "memcpy HtoD (0.0 MB)",
      "## phase after:",
  };
  int bad = 0;
  for (const char* w : want)
    if (r.find(w) == std::string::npos) { fprintf(stderr, "report lacks: %s\n", w); bad = 1; }
  if (bad) fprintf(stderr, "--- report:\n%s", r.c_str());
  else printf("cupti_profile selftest: OK\n");
  return bad;
}
