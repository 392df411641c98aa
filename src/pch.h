// Precompiled header for every fsdp-cpp target (see CMakeLists.txt).
#pragma once
#include <torch/torch.h>
#include "fsdp/compat.h"
#include "fsdp/compat_backends.h"
