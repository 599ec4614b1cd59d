# Sourced by tools/gpu-check.sh and tools/gpu-check-bundle.sh: which test suites hold GPU tests,
# found from the sources so that a new GPU test is picked up by both without a list to update.
# A GPU test is one whose suite or test name contains Cuda, Gpu or Nccl, or a backend case
# table row run on a CUDA device (test_backend's EveryBackend/OpCases.cuda0_...).
gpu_pattern='Cuda|Gpu|Nccl|\.cuda[0-9]'

# Suites (test file stems) that contain tests named like GPU tests. Run from the source root.
discover_gpu_suites() {
  local f s
  for f in tests/test_*.cpp; do
    if grep -Eq "^TEST(_F)?\([A-Za-z0-9_]*($gpu_pattern)[A-Za-z0-9_]*, |^TEST(_F)?\([A-Za-z0-9_]+, [A-Za-z0-9_]*($gpu_pattern)" "$f"; then
      s=$(basename "$f" .cpp)
      echo "${s#test_}"
    fi
  done
}
