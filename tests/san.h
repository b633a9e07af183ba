/*
 * Which sanitizer a test is built under, for what their shadow memory defeats (check.h includes
 * it). Their slowness is the build's to scale: EMBER_TEST_TIME_SCALE (tests/CMakeLists.txt).
 */
#ifndef EMBER_TESTS_SAN_H
#define EMBER_TESTS_SAN_H

/* 1 in a build under AddressSanitizer / ThreadSanitizer (GCC says so with __SANITIZE_*__, clang
 * with __has_feature), for the checks their shadow memory defeats: RSS bounds (TSan's shadow
 * grows with every byte touched, ASan's quarantine holds freed memory) and address-space
 * limits. */
#if defined(__SANITIZE_ADDRESS__)
#define CHECK_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CHECK_ASAN 1
#endif
#endif
#ifndef CHECK_ASAN
#define CHECK_ASAN 0
#endif
#if defined(__SANITIZE_THREAD__)
#define CHECK_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define CHECK_TSAN 1
#endif
#endif
#ifndef CHECK_TSAN
#define CHECK_TSAN 0
#endif

#endif
