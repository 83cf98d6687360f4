// The kernels and launchers for float32 inputs, Launchers<float> of launchers_by_dtype.h:
// instantiated here alone, so that nvcc compiles each input type's kernels in a translation
// unit of its own, in parallel as ninja builds the extension.
#include "launch.cuh"

template struct ks_cuda::Launchers<float>;
