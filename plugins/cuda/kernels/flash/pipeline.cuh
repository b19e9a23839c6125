// The asynchronous pipeline's parts (sm_90a): TMA descriptors, mbarriers and the box copies the
// producer warps issue.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The wgmma forward, with a producer warp (FlashAttention-3's warp specialisation): one CTA of
// three warpgroups per query head and 128-row query tile (or two 64-row ones). The first
// warpgroup gives its registers back and one of its threads issues every load — Q once, then
// each K and V tile of the work list — as TMA copies that swizzle the tiles as wgmma reads them
// (every product reads its B operand from shared memory through a descriptor) and signal an
// mbarrier when their bytes have landed; the other two (64 rows each) only compute: no cp.async
// address arithmetic and no CTA barrier per tile. K and V have STAGES buffers each, each with a
// "full" barrier (the producer's copies landed) and an "empty" one (the consumers are done with
// it).
__device__ __forceinline__ void barrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(shared_address(bar)), "r"(count) : "memory");
}
// This thread's arrival, announcing `bytes` more to come by TMA before the phase completes.
__device__ __forceinline__ void barrier_expect_bytes(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(shared_address(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void barrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(shared_address(bar)) : "memory");
}
// Until the barrier's phase of parity `parity` has completed (a fresh barrier counts the phase
// before its first, parity 1, as completed).
__device__ __forceinline__ void barrier_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\nwait:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra wait;\n}\n" :: "r"(shared_address(bar)), "r"(parity) : "memory");
}
// Rows row.. of one 64-column panel (columns column..column + 63) of head `head` of a
// [heads][seqlen][128] 16-bit tensor, as the map's box (64 columns × its rows) lays them out with
// the 128-byte swizzle; rows past the sequence arrive as zeros. Completes on `bar`.
__device__ __forceinline__ void load_box(u16* dst, const TensorMap* map, int column, int row, int head, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(shared_address(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(column), "r"(row), "r"(head),
                    "r"(shared_address(bar)) : "memory");
}

// A ring of STAGES buffers between a producer and its consumers, owning their mbarriers and phase
// bits: use j of the ring takes stage j mod STAGES in phase j / STAGES. `full` completes when the
// producer's copies (or arrivals) for a use have landed, `empty` when every consumer is done with
// it; a fresh ring counts every stage as empty.
template <int STAGES>
struct StageRing {
    unsigned long long full[STAGES], empty[STAGES];

    // By one thread, before the block's barrier: `arrivals` producer arrivals complete a use,
    // `consumers` consumer ones free it.
    __device__ __forceinline__ void init(unsigned arrivals, unsigned consumers) {
        for (int i = 0; i < STAGES; ++i) {
            barrier_init(&full[i], arrivals);
            barrier_init(&empty[i], consumers);
        }
    }
    // The producer, before filling use j: until the consumers are done with the stage's last use.
    __device__ __forceinline__ void acquire(int j) { barrier_wait(&empty[j % STAGES], ((j / STAGES) & 1) ^ 1); }
    // The barrier use j's copies and arrivals complete.
    __device__ __forceinline__ unsigned long long* filled(int j) { return &full[j % STAGES]; }
    // A consumer, before reading use j: until it has landed.
    __device__ __forceinline__ void wait(int j) { barrier_wait(&full[j % STAGES], (j / STAGES) & 1); }
    // A consumer done with use j.
    __device__ __forceinline__ void release(int j) { barrier_arrive(&empty[j % STAGES]); }
};

// The register budgets of a warp-specialised block: the producer warpgroup, which only issues
// copies, keeps 40 registers a thread and hands the rest to the consumers' accumulators.
constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;

// A warp-specialised block after its barriers are set up: the first warpgroup runs `produce`, the
// others `consume`, each with its register budget (setmaxnreg is per warpgroup, so every thread
// of each takes part before it may return).
template <class Producer, class Consumer>
__device__ __forceinline__ void warp_specialised(Producer produce, Consumer consume) {
    if (threadIdx.x < HOPPER_WARPGROUP) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(PRODUCER_REGISTERS));
        produce();
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(CONSUMER_REGISTERS));
        consume();
    }
}

#endif
