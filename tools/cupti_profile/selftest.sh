#!/usr/bin/env bash
# Checks kernel_profile.cc's phases and report without a GPU: builds it against fake_cupti.cc
# (a libcupti.so.13 stand-in fed made-up records) and runs selftest.cc. tools/gpu_prepare.sh
# runs it before packing the profiler.
#   selftest.sh CUPTI_INCLUDE CUDA_INCLUDE
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
inc=(-I"$1" -I"$2")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
g++ -O1 -g -std=c++17 -shared -fPIC "${inc[@]}" "$here/fake_cupti.cc" -Wl,-soname,libcupti.so.13 \
  -o "$work/libcupti.so.13"
g++ -O1 -g -std=c++17 -Wall -Wextra -Werror -shared -fPIC "${inc[@]}" "$here/kernel_profile.cc" \
  -o "$work/libkernel_profile.so" -L"$work" -l:libcupti.so.13
g++ -O1 -g -std=c++17 "${inc[@]}" "$here/selftest.cc" -o "$work/selftest" -L"$work" -l:libcupti.so.13 -ldl
LD_LIBRARY_PATH="$work" "$work/selftest" "$work/libkernel_profile.so" "$work/report.txt"
[ -z "${SHOW:-}" ] || cat "$work/report.txt"
