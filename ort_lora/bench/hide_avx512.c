// Preloaded into a benchmark's processes (LD_PRELOAD; ort_lora/bench/hide_avx512.py builds
// and sets it), this makes an AVX-512 x86 CPU look like an AVX2-only one to every library
// that asks CPUID what it may use: the op library, ONNX Runtime's MLAS, llama.cpp's build
// (-march=native) and the peers all take their AVX2 code paths, so an AVX2 comparison on
// such a machine compares AVX2 code with AVX2 code.
//
// How: CPUID faulting (arch_prctl ARCH_SET_CPUID, 0; /proc/cpuinfo flag cpuid_fault) makes
// every CPUID instruction of the process raise SIGSEGV. The handler runs the real CPUID with
// faulting off for that instruction, clears the AVX-512, AVX-VNNI and AMX bits of leaf 7,
// and steps over the instruction. The setting is inherited by threads and forks and reset by
// execve, where LD_PRELOAD brings it back. Programs that install their own SIGSEGV handler
// (Python's faulthandler, the compiler's crash reporter) get it through sigaction/signal
// below and are called for every SIGSEGV that is not a CPUID.
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

typedef int (*SigactionFn)(int, const struct sigaction*, struct sigaction*);

static struct sigaction app_segv;  // the program's own SIGSEGV disposition
static int faulting;               // 1 once CPUID faults in this process
static long traps;                 // CPUIDs answered (a hot-path CPUID would show here)

// Leaf 7 sub-leaf 0: EBX avx512 f dq ifma pf er cd bw vl; ECX avx512 vbmi vbmi2 vnni bitalg
// vpopcntdq; EDX avx512 4vnniw 4fmaps vp2intersect, amx bf16, avx512 fp16, amx tile int8.
static const uint32_t kLeaf7Ebx = (1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) |
                                  (1u << 28) | (1u << 30) | (1u << 31);
static const uint32_t kLeaf7Ecx = (1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14);
static const uint32_t kLeaf7Edx =
    (1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) | (1u << 25);
// Sub-leaf 1: EAX avx-vnni avx512-bf16 avx-ifma; EDX avx-vnni-int8 avx-ne-convert avx10.
static const uint32_t kLeaf71Eax = (1u << 4) | (1u << 5) | (1u << 23);
static const uint32_t kLeaf71Edx = (1u << 4) | (1u << 5) | (1u << 19);

static SigactionFn RealSigaction(void) {
  static SigactionFn fn;
  if (!fn) fn = (SigactionFn)dlsym(RTLD_NEXT, "sigaction");
  return fn;
}

static void Cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
  __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

static void PassOn(int sig, siginfo_t* info, void* context) {
  if (app_segv.sa_flags & SA_SIGINFO) {
    app_segv.sa_sigaction(sig, info, context);
  } else if (app_segv.sa_handler != SIG_DFL && app_segv.sa_handler != SIG_IGN) {
    app_segv.sa_handler(sig);
  } else {  // returning re-runs the faulting instruction, which the default action ends
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    RealSigaction()(SIGSEGV, &dfl, 0);
  }
}

static void OnSegv(int sig, siginfo_t* info, void* context) {
  greg_t* g = ((ucontext_t*)context)->uc_mcontext.gregs;
  const uint8_t* ip = (const uint8_t*)g[REG_RIP];
  if (info->si_code != SI_KERNEL || ip[0] != 0x0f || ip[1] != 0xa2) {
    PassOn(sig, info, context);
    return;
  }
  uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX], r[4];
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
  Cpuid(leaf, sub, r);
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
  if (leaf == 7 && sub == 0) {
    r[1] &= ~kLeaf7Ebx;
    r[2] &= ~kLeaf7Ecx;
    r[3] &= ~kLeaf7Edx;
  } else if (leaf == 7 && sub == 1) {
    r[0] &= ~kLeaf71Eax;
    r[3] &= ~kLeaf71Edx;
  }
  g[REG_RAX] = r[0];
  g[REG_RBX] = r[1];
  g[REG_RCX] = r[2];
  g[REG_RDX] = r[3];
  g[REG_RIP] += 2;
  __atomic_add_fetch(&traps, 1, __ATOMIC_RELAXED);
}

int sigaction(int sig, const struct sigaction* act, struct sigaction* old) {
  if (sig != SIGSEGV || !faulting) return RealSigaction()(sig, act, old);
  if (old) *old = app_segv;
  if (act) app_segv = *act;
  return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
  struct sigaction act, old;
  memset(&act, 0, sizeof act);
  act.sa_handler = handler;
  act.sa_flags = SA_RESTART;
  if (sigaction(sig, &act, &old) != 0) return SIG_ERR;
  return old.sa_handler;
}

// For hide_avx512.py: 1 when CPUID faults here (the AVX-512 bits are hidden), else 0.
int ort_lora_hide_avx512_active(void) { return faulting; }
long ort_lora_hide_avx512_traps(void) { return __atomic_load_n(&traps, __ATOMIC_RELAXED); }

__attribute__((constructor)) static void Init(void) {
  struct sigaction act;
  memset(&act, 0, sizeof act);
  act.sa_sigaction = OnSegv;
  act.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  if (RealSigaction()(SIGSEGV, &act, &app_segv) != 0) return;
  if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) == 0) {
    faulting = 1;
    return;
  }
  RealSigaction()(SIGSEGV, &app_segv, 0);
  static const char kWhy[] = "hide_avx512: CPUID faulting unavailable; AVX-512 not hidden\n";
  (void)!write(2, kWhy, sizeof kWhy - 1);
}
