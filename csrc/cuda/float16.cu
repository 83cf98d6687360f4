// The kernels and launchers for float16 inputs, Launchers<__half> of launchers_by_dtype.h:
// instantiated here alone, so that nvcc compiles each input type's kernels in a translation
// unit of its own, in parallel as ninja builds the extension.
#include "launch.cuh"

template struct ks_cuda::Launchers<__half>;
