// What the kernels take from PyTorch: the Tensor class with its methods, the thread pool and the few
// factory functions they call, and no more. <torch/extension.h> (autograd, the C++ frontend, pybind11,
// Python's headers) took 3-5 minutes a file on 2 cores under load and ~75% of a first start's build;
// only bindings.cpp, which converts between Python and these functions, includes it.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
