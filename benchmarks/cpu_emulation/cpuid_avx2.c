// Makes a process see an AVX2-only x86 CPU (no AVX-512, no AVX-512 BF16/FP16,
// no AMX, no AVX-VNNI), to measure what mixprec does on such a CPU while running
// on a newer one.
//
// How: Linux's CPUID faulting (arch_prctl(ARCH_SET_CPUID, 0), x86 CPUs and KVM
// guests that report the `cpuid_fault` flag) turns every CPUID instruction of
// the process into a SIGSEGV. The handler below executes the real CPUID (with
// faulting briefly off), clears the feature bits of leaf 7, and resumes after
// the instruction. Everything that asks the CPU (XLA's LLVM code generator,
// YNNPACK's and oneDNN's kernel dispatch through cpuinfo, NumPy) then picks
// its AVX2 code. The setting is per thread and inherited by threads created
// later, so it is made in a constructor, before the program starts threads.
//
// Build and use (benchmarks/bench_cpu_bf16.py --emulate-cpu avx2 does both):
//   cc -O2 -shared -fPIC -o libcpuid_avx2.so cpuid_avx2.c
//   LD_PRELOAD=$PWD/libcpuid_avx2.so python ...
//
// Limits: the cores, caches and memory are still the host's, so absolute times
// are not those of any real AVX2 machine, only which instructions and kernels
// run. A SIGSEGV handler installed later by the program (Python's faulthandler,
// `python -X faulthandler`, pytest) replaces this one: do not enable one.
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

// Read by the benchmark (ctypes) to check that the mask is in effect.
volatile long mixprec_cpuid_masked_calls = 0;
int mixprec_cpuid_faulting = 0;

static void real_cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
  __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
}

static void mask(unsigned leaf, unsigned sub, unsigned r[4]) {
  if (leaf == 7 && sub == 0) {
    // EBX: AVX512F, DQ, IFMA, PF, ER, CD, BW, VL.
    r[1] &= ~((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) |
              (1u << 28) | (1u << 30) | (1u << 31));
    // ECX: AVX512_VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ.
    r[2] &= ~((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14));
    // EDX: AVX512_4VNNIW, 4FMAPS, VP2INTERSECT, AMX_BF16, AVX512_FP16,
    // AMX_TILE, AMX_INT8.
    r[3] &= ~((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) |
              (1u << 24) | (1u << 25));
  } else if (leaf == 7 && sub == 1) {
    // EAX: AVX_VNNI, AVX512_BF16, AMX_FP16, AVX_IFMA.
    r[0] &= ~((1u << 4) | (1u << 5) | (1u << 21) | (1u << 23));
  }
}

static void on_segv(int sig, siginfo_t* info, void* context) {
  (void)sig;
  (void)info;
  ucontext_t* uc = (ucontext_t*)context;
  greg_t* g = uc->uc_mcontext.gregs;
  const unsigned char* ip = (const unsigned char*)g[REG_RIP];
  if (ip[0] == 0x0f && ip[1] == 0xa2) {  // CPUID
    unsigned r[4];
    unsigned leaf = (unsigned)g[REG_RAX], sub = (unsigned)g[REG_RCX];
    real_cpuid(leaf, sub, r);
    mask(leaf, sub, r);
    g[REG_RAX] = r[0];
    g[REG_RBX] = r[1];
    g[REG_RCX] = r[2];
    g[REG_RDX] = r[3];
    g[REG_RIP] += 2;
    mixprec_cpuid_masked_calls++;
    return;
  }
  // A real fault: restore the default action, which the retried instruction
  // then takes.
  signal(SIGSEGV, SIG_DFL);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  if (sigaction(SIGSEGV, &sa, NULL) != 0) return;
  if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) {
    fprintf(stderr, "cpuid_avx2: CPUID faulting is not available here\n");
    return;
  }
  mixprec_cpuid_faulting = 1;
}
