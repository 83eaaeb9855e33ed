/* Device memory (ibv_alloc_dm(3)): max_dm_size in ibv_query_device_ex; allocation, copies
 * and freeing with mlx5's errnos (EINVAL for a size above max_dm_size, a comp_mask or an
 * unaligned copy; EFAULT for a copy outside the allocation; ENOMEM when no room is left;
 * EBUSY while a region uses it); zero-based regions (ibv_reg_dm_mr, IBV_ACCESS_ZERO_BASED
 * required) as the source and target of SENDs, RDMA WRITEs, READs and atomics between rb0
 * and rb1; a forked child that allocates device memory of its own. */
#include "common.h"
#include <sys/wait.h>

static struct side a, b;

static struct ibv_dm *alloc_dm(struct ibv_context *ctx, size_t len, uint32_t log_align)
{
	struct ibv_alloc_dm_attr attr = {.length = len, .log_align_req = log_align};
	return ibv_alloc_dm(ctx, &attr);
}

/* One signaled work request from a, waited for. */
static void post_a(enum ibv_wr_opcode op, struct ibv_sge *sge, uint64_t raddr, uint32_t rkey,
		   enum ibv_wc_opcode want)
{
	struct ibv_send_wr wr = {
		.wr_id = 9,
		.sg_list = sge,
		.num_sge = 1,
		.opcode = op,
		.send_flags = IBV_SEND_SIGNALED,
	};
	if (op == IBV_WR_ATOMIC_FETCH_AND_ADD) {
		wr.wr.atomic.remote_addr = raddr;
		wr.wr.atomic.rkey = rkey;
		wr.wr.atomic.compare_add = 5;
	} else {
		wr.wr.rdma.remote_addr = raddr;
		wr.wr.rdma.rkey = rkey;
	}
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(a.qp, &wr, &bad), 0);
	struct ibv_wc wc;
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, want);
}

int main(void)
{
	struct qp_opts o = default_qp_opts();
	pair_open(&a, &b, 0, 1 << 16, 64, &o);

	struct ibv_device_attr_ex ax;
	CHECK_RET(ibv_query_device_ex(a.ctx, NULL, &ax), 0);
	size_t max = ax.max_dm_size;
	CHECK_EQ(max, 128 << 10);

	/* ---- allocation ---- */
	CHECK_NULL_ERRNO(alloc_dm(a.ctx, max + 1, 0), EINVAL);
	CHECK_NULL_ERRNO(alloc_dm(a.ctx, 0, 0), EINVAL);
	struct ibv_alloc_dm_attr bad_mask = {.length = 64, .comp_mask = 1};
	CHECK_NULL_ERRNO(ibv_alloc_dm(a.ctx, &bad_mask), EINVAL);
	struct ibv_dm *whole = alloc_dm(a.ctx, max, 6);
	CHECK(whole != NULL);
	CHECK(whole->context == a.ctx);
	CHECK_NULL_ERRNO(alloc_dm(a.ctx, 4, 0), ENOMEM);
	CHECK_RET(ibv_free_dm(whole), 0);

	/* ---- copies ---- */
	struct ibv_dm *dm = alloc_dm(a.ctx, 4096, 3);
	CHECK(dm != NULL);
	uint8_t out[4096], in[4096];
	fill(out, sizeof(out), 3);
	CHECK_RET(ibv_memcpy_to_dm(dm, 0, out, sizeof(out)), 0);
	memset(in, 0, sizeof(in));
	CHECK_RET(ibv_memcpy_from_dm(in, dm, 0, sizeof(in)), 0);
	CHECK_MEM(in, out, sizeof(in));
	CHECK_RET(ibv_memcpy_to_dm(dm, 100, out + 100, 260), 0);
	CHECK_RET(ibv_memcpy_from_dm(in, dm, 100, 260), 0);
	CHECK_MEM(in, out + 100, 260);
	CHECK_RET(ibv_memcpy_to_dm(dm, 4096, out, 4), EFAULT);
	CHECK_RET(ibv_memcpy_from_dm(in, dm, 4092, 8), EFAULT);
	CHECK_RET(ibv_memcpy_to_dm(dm, 2, out, 4), EINVAL);
	CHECK_RET(ibv_memcpy_from_dm(in, dm, 4, 6), EINVAL);
	CHECK_RET(ibv_memcpy_to_dm(dm, UINT64_MAX - 3, out, 8), EFAULT);

	/* ---- regions ---- */
	CHECK_NULL_ERRNO(ibv_reg_dm_mr(a.pd, dm, 0, 64, IBV_ACCESS_LOCAL_WRITE), EINVAL);
	CHECK_NULL_ERRNO(ibv_reg_dm_mr(a.pd, dm, 0, 4097,
				       IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE),
			 EINVAL);
	CHECK_NULL_ERRNO(ibv_reg_dm_mr(a.pd, dm, 0, 64,
				       IBV_ACCESS_ZERO_BASED | IBV_ACCESS_REMOTE_WRITE),
			 EINVAL);
	struct ibv_mr *empty =
		ibv_reg_dm_mr(a.pd, dm, 0, 0, IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE);
	CHECK(empty != NULL);
	CHECK_RET(ibv_dereg_mr(empty), 0);
	struct ibv_mr *amr = ibv_reg_dm_mr(a.pd, dm, 0, 4096, IBV_ACCESS_ZERO_BASED | ACC_ALL);
	CHECK(amr != NULL);
	CHECK(amr->addr == NULL);
	CHECK_EQ(amr->length, 4096);
	CHECK_RET(ibv_free_dm(dm), EBUSY);
	/* A PD that holds a region of device memory is busy too. */
	CHECK_RET(ibv_dealloc_pd(a.pd), EBUSY);

	struct ibv_dm *bdm = alloc_dm(b.ctx, 8192, 6);
	CHECK(bdm != NULL);
	struct ibv_mr *bmr =
		ibv_reg_dm_mr(b.pd, bdm, 4096, 4096, IBV_ACCESS_ZERO_BASED | ACC_ALL);
	CHECK(bmr != NULL);
	/* Another context's device memory is refused. */
	CHECK_NULL_ERRNO(ibv_reg_dm_mr(a.pd, bdm, 0, 64, IBV_ACCESS_ZERO_BASED | ACC_ALL), EINVAL);

	/* SEND from a's device memory into b's. */
	struct ibv_sge rs = {.addr = 16, .length = 2048, .lkey = bmr->lkey};
	struct ibv_recv_wr rw = {.wr_id = 4, .sg_list = &rs, .num_sge = 1}, *rbad = NULL;
	CHECK_RET(ibv_post_recv(b.qp, &rw, &rbad), 0);
	struct ibv_sge ss = {.addr = 0, .length = 1000, .lkey = amr->lkey};
	post_a(IBV_WR_SEND, &ss, 0, 0, IBV_WC_SEND);
	struct ibv_wc wc;
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.byte_len, 1000);
	CHECK_RET(ibv_memcpy_from_dm(in, bdm, 4096 + 16, 1000), 0);
	CHECK_MEM(in, out, 1000);

	/* RDMA WRITE from host memory into b's device memory, READ it back into a's. */
	fill(a.buf, 512, 7);
	struct ibv_sge ws = {.addr = (uintptr_t)a.buf, .length = 512, .lkey = a.mr->lkey};
	post_a(IBV_WR_RDMA_WRITE, &ws, 2048, bmr->rkey, IBV_WC_RDMA_WRITE);
	CHECK_RET(ibv_memcpy_from_dm(in, bdm, 4096 + 2048, 512), 0);
	CHECK_MEM(in, a.buf, 512);
	struct ibv_sge rd = {.addr = 1024, .length = 512, .lkey = amr->lkey};
	post_a(IBV_WR_RDMA_READ, &rd, 2048, bmr->rkey, IBV_WC_RDMA_READ);
	CHECK_RET(ibv_memcpy_from_dm(in, dm, 1024, 512), 0);
	CHECK_MEM(in, a.buf, 512);

	/* Fetch-and-add on b's device memory; the old value lands in a's. */
	uint64_t v = 37;
	CHECK_RET(ibv_memcpy_to_dm(bdm, 4096 + 3000, &v, 8), 0);
	struct ibv_sge fs = {.addr = 3000, .length = 8, .lkey = amr->lkey};
	post_a(IBV_WR_ATOMIC_FETCH_AND_ADD, &fs, 3000, bmr->rkey, IBV_WC_FETCH_ADD);
	CHECK_RET(ibv_memcpy_from_dm(&v, bdm, 4096 + 3000, 8), 0);
	CHECK_EQ(v, 42);
	CHECK_RET(ibv_memcpy_from_dm(&v, dm, 3000, 8), 0);
	CHECK_EQ(v, 37);

	/* ---- a forked child allocates device memory of its own ---- */
	fflush(NULL);
	pid_t pid = fork();
	CHECK(pid >= 0);
	if (pid == 0) {
		struct ibv_dm *c = alloc_dm(a.ctx, 1024, 0);
		uint32_t w = 0xabcd, r = 0;
		int ok = c && ibv_memcpy_to_dm(c, 0, &w, 4) == 0 &&
			 ibv_memcpy_from_dm(&r, c, 0, 4) == 0 && r == w && ibv_free_dm(c) == 0;
		_exit(ok ? 0 : 1);
	}
	int st = 0;
	CHECK_EQ(waitpid(pid, &st, 0), pid);
	CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	/* The parent's memory is as it was. */
	CHECK_RET(ibv_memcpy_from_dm(in, dm, 0, 1000), 0);
	CHECK_MEM(in, out, 1000);

	CHECK_RET(ibv_dereg_mr(bmr), 0);
	CHECK_RET(ibv_free_dm(bdm), 0);
	CHECK_RET(ibv_dereg_mr(amr), 0);
	CHECK_RET(ibv_free_dm(dm), 0);
	/* A DM freed twice is not a DM: EINVAL, no crash. */
	/* (Not called: libibverbs dereferences dm->context before asking the provider.) */
	side_close(&a);
	side_close(&b);
	printf("device memory: every check passed\n");
	return 0;
}
