// Whether this build runs under AddressSanitizer: FSDP_TEST_ASAN is 1 or 0. GCC says so with
// __SANITIZE_ADDRESS__, clang (16 here) only through __has_feature(address_sanitizer).
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define FSDP_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FSDP_TEST_ASAN 1
#endif
#endif
#ifndef FSDP_TEST_ASAN
#define FSDP_TEST_ASAN 0
#endif
