/* The busy-poll wait of the event loop's selector (meshnode/net/busypoll.py), in C.
 *
 * Polls a descriptor (the selector's own epoll or kqueue descriptor, readable while any
 * registered socket has something for the loop) without sleeping, until it is readable or
 * `spin_ns` nanoseconds have passed. It runs through ctypes, which releases the GIL for
 * the whole call, so the spin never keeps the process's other threads (the llama.cpp
 * compute thread, zeroconf) from the interpreter; a spin in Python would, since a thread
 * that drops and retakes the GIL in a tight loop starves every thread waiting for it.
 * No Python API used.
 */
#include <poll.h>
#include <stdint.h>
#include <time.h>

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* 1: readable; 0: not within spin_ns; -1: poll failed (the caller's select reports it). */
int meshnode_spin_readable(int fd, int64_t spin_ns) {
    struct pollfd p = {.fd = fd, .events = POLLIN, .revents = 0};
    const int64_t end = now_ns() + spin_ns;
    for (;;) {
        int r = poll(&p, 1, 0);
        if (r != 0) {
            return r < 0 ? -1 : 1;
        }
        if (now_ns() >= end) {
            return 0;
        }
        cpu_relax();
    }
}
