/* Protection domains and memory regions: registering every kind of process memory (heap,
 * aligned heap, stack, anonymous mapping, static data) and moving data through each with
 * RDMA WRITE and READ; an MR whose iova differs from its address; bad access flags and
 * lengths; EBUSY, double deregistration and deallocation, NULL pointers; ibv_rereg_mr.
 * The program interposes mremap as UCX's memory hooks do, losing the target address of
 * MREMAP_FIXED: the library's own remapping of registered pages must not go through it. */
#include "common.h"
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/wait.h>

/* Like UCX 1.13's memory hooks (ucm): an mremap that forwards four arguments, so a move to
 * a fixed address goes wherever the kernel likes. Had the library moved a registered
 * region's memory file over the program's pages through it, the program would keep its
 * old pages while the NIC wrote the file: every check of data written into registered
 * memory below would fail. */
static int mremap_calls;
void *mremap(void *old, size_t old_size, size_t new_size, int flags, ...)
{
	mremap_calls++;
	void *(*real)(void *, size_t, size_t, int, ...) =
		(void *(*)(void *, size_t, size_t, int, ...))dlsym(RTLD_NEXT, "mremap");
	return real(old, old_size, new_size, flags & ~MREMAP_FIXED);
}

static struct side a, b;

/* Posts one signaled RDMA operation from a's buffer at `loff` and waits for it. */
static void rdma(enum ibv_wr_opcode op, size_t loff, uint64_t raddr, uint32_t rkey,
		 uint32_t len)
{
	struct ibv_sge sge = {
		.addr = (uintptr_t)(a.buf + loff), .length = len, .lkey = a.mr->lkey};
	struct ibv_send_wr wr = {
		.wr_id = 0x5eed,
		.sg_list = &sge,
		.num_sge = 1,
		.opcode = op,
		.send_flags = IBV_SEND_SIGNALED,
	};
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(a.qp, &wr, &bad), 0);
	struct ibv_wc wc;
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS,
		  op == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ : IBV_WC_RDMA_WRITE);
	CHECK_EQ(wc.wr_id, 0x5eed);
	CHECK_EQ(wc.qp_num, a.qp->qp_num);
}

/* Registers `mem` (len bytes) on b, writes a pattern into it from a, reads it back into a
 * and checks both directions byte for byte. */
static void through(const char *what, void *mem, size_t len, unsigned seed)
{
	struct ibv_mr *mr = ibv_reg_mr(b.pd, mem, len, ACC_ALL);
	if (!mr)
		FAIL("ibv_reg_mr of %s memory (%zu bytes) failed: %s", what, len,
		     strerror(errno));
	CHECK(mr->addr == mem);
	CHECK_EQ(mr->length, len);
	CHECK(mr->pd == b.pd);
	CHECK(mr->context == b.ctx);
	memset(mem, 0, len);
	fill(a.buf, len, seed);
	rdma(IBV_WR_RDMA_WRITE, 0, (uintptr_t)mem, mr->rkey, len);
	CHECK_MEM(mem, a.buf, len);
	/* Change it locally and read it back. */
	fill(mem, len, seed + 1);
	memset(a.buf + len, 0, len);
	rdma(IBV_WR_RDMA_READ, len, (uintptr_t)mem, mr->rkey, len);
	CHECK_MEM(a.buf + len, mem, len);
	CHECK_RET(ibv_dereg_mr(mr), 0);
	printf("  %s: %zu bytes written and read back\n", what, len);
}

/* A process that registered some of its stack memory forks: the child must run. Done in a
 * child of its own, first thing, before this process registers anything (registered pages
 * may end up shared with children, see the heap fork check below). */
static void fork_after_stack_registration(void)
{
	/* With the bug, the grandchild returns from fork() on a stack page it shares with the
	 * helper, whose calls overwrite it: the grandchild may run anywhere, or never end. So
	 * the check runs only when asked to fail on known bugs; otherwise it is reported. */
	const char *strict = getenv("RINGBELL_VERBS_STRICT");
	if (!strict || strcmp(strict, "1") != 0) {
		printf("KNOWN BUG (not run; RINGBELL_VERBS_STRICT=1 runs it): fork() after "
		       "ibv_reg_mr of stack memory shares the registered stack page with the child\n");
		return;
	}
	fflush(NULL);
	pid_t p = fork();
	CHECK(p >= 0);
	if (p == 0) {
		struct ibv_context *ctx = open_dev("rb0");
		struct ibv_pd *pd = ibv_alloc_pd(ctx);
		char buf[256];
		struct ibv_mr *mr =
			pd ? ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE) : NULL;
		if (!mr)
			_exit(2);
		/* Not on the stack: with the bug below, the grandchild shares the registered
		 * stack page and its writes would change the helper's locals. */
		static pid_t g;
		static int st;
		g = fork();
		if (g < 0)
			_exit(4);
		if (g == 0)
			_exit(0);
		if (waitpid(g, &st, 0) != g)
			_exit(3);
		_exit(WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 3);
	}
	int st = 0;
	CHECK_EQ(waitpid(p, &st, 0), p);
	if (WIFEXITED(st) && WEXITSTATUS(st) == 2)
		FAIL("registering stack memory in the forked helper failed");
	if (WIFEXITED(st) && WEXITSTATUS(st) == 4)
		FAIL("fork() failed in the forked helper");
	KNOWN_BUG(WIFEXITED(st) && WEXITSTATUS(st) == 0,
		  "fork() after ibv_reg_mr of stack memory: the child %s (wait status 0x%x)",
		  WIFEXITED(st) ? "died (its own child was killed)" : "was killed", st);
}

static uint8_t static_buf[3000];
static const uint8_t ro_data[2000] = {1, 2, 3, 4, 5, 6, 7, 8, [1999] = 9};

int main(void)
{
	fork_after_stack_registration();
	struct qp_opts o = default_qp_opts();
	/* a.buf holds a pattern and a read-back copy of the largest region (64 KiB). */
	pair_open(&a, &b, 0, 1 << 17, 64, &o);

	/* ---- fork: a child's writes stay the child's ---- */
	{
		/* POSIX fork semantics, which rdma-core keeps (with or without ibv_fork_init):
		 * the parent's registered memory never sees what a child writes. (This runs
		 * before any stack memory is registered: registered stack pages next to the
		 * caller of fork stay shared with the child, see fork_after_stack_registration.) */
		uint8_t *mem = malloc(4096);
		CHECK(mem != NULL);
		memset(mem, 0x11, 4096);
		struct ibv_mr *mr = ibv_reg_mr(b.pd, mem, 4096, ACC_ALL);
		CHECK(mr != NULL);
		fflush(NULL);
		pid_t pid = fork();
		CHECK(pid >= 0);
		if (pid == 0) {
			memset(mem, 0x77, 4096);
			_exit(0);
		}
		int status = 0;
		CHECK_EQ(waitpid(pid, &status, 0), pid);
		CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
		/* The child got a copy of the registered pages (the library's fork handlers). */
		CHECK_EQ(mem[0], 0x11);
		CHECK_EQ(mem[4095], 0x11);
		/* The region still works in the parent. */
		fill(a.buf, 64, 23);
		rdma(IBV_WR_RDMA_WRITE, 0, (uintptr_t)mem, mr->rkey, 64);
		CHECK_MEM(mem, a.buf, 64);
		CHECK_RET(ibv_dereg_mr(mr), 0);
		free(mem);
	}

	/* ---- every kind of memory ---- */
	uint8_t *heap = malloc(5000);
	CHECK(heap != NULL);
	through("malloc", heap, 5000, 1);
	free(heap);

	void *aligned = NULL;
	CHECK_EQ(posix_memalign(&aligned, 4096, 3 * 4096), 0);
	through("posix_memalign", aligned, 3 * 4096, 2);
	/* An unaligned window inside it. */
	through("posix_memalign+13", (uint8_t *)aligned + 13, 4096, 3);
	free(aligned);

	uint8_t stack[1500];
	through("stack", stack, sizeof(stack), 4);

	void *anon = mmap(NULL, 1 << 16, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
			  0);
	CHECK(anon != MAP_FAILED);
	through("anonymous mmap", anon, 1 << 16, 5);
	CHECK_EQ(munmap(anon, 1 << 16), 0);

	through("static", static_buf, sizeof(static_buf), 6);
	/* None of those registrations went through the program's mremap. */
	CHECK_EQ(mremap_calls, 0);

	/* ---- an iova of its own ---- */
	{
		uint8_t *mem = malloc(8192);
		CHECK(mem != NULL);
		memset(mem, 0, 8192);
		uint64_t iova = 0x7000000000ull + 0x40;
		CHECK(iova != (uintptr_t)mem);
		struct ibv_mr *mr = ibv_reg_mr_iova2(b.pd, mem, 8192, iova, ACC_ALL);
		CHECK(mr != NULL);
		CHECK(mr->addr == mem);
		fill(a.buf, 100, 7);
		/* iova + 1000 names mem[1000]. */
		rdma(IBV_WR_RDMA_WRITE, 0, iova + 1000, mr->rkey, 100);
		CHECK_MEM(mem + 1000, a.buf, 100);
		static const uint8_t zero[1000];
		CHECK_MEM(mem, zero, 1000);
		CHECK_MEM(mem + 1100, zero, 1000);
		/* ibv_reg_mr_iova (the older call) too. */
		struct ibv_mr *mr2 = ibv_reg_mr_iova(b.pd, mem + 4096, 4096, 0x1000, ACC_ALL);
		CHECK(mr2 != NULL);
		fill(a.buf, 64, 8);
		rdma(IBV_WR_RDMA_WRITE, 0, 0x1000 + 64, mr2->rkey, 64);
		CHECK_MEM(mem + 4096 + 64, a.buf, 64);
		CHECK_RET(ibv_dereg_mr(mr2), 0);
		CHECK_RET(ibv_dereg_mr(mr), 0);
		free(mem);
		printf("  iova: writes land at addr + (target - iova)\n");
	}

	/* ---- read-only memory, bad addresses, shared mappings, overlaps ---- */
	{
		/* Read-only data registers for reading (local or remote), not for writing. */
		struct ibv_mr *ro = ibv_reg_mr(b.pd, (void *)ro_data, sizeof(ro_data),
					       IBV_ACCESS_REMOTE_READ);
		CHECK(ro != NULL);
		memset(a.buf, 0, sizeof(ro_data));
		rdma(IBV_WR_RDMA_READ, 0, (uintptr_t)ro_data, ro->rkey, sizeof(ro_data));
		CHECK_MEM(a.buf, ro_data, sizeof(ro_data));
		CHECK_RET(ibv_dereg_mr(ro), 0);
		errno = 0;
		struct ibv_mr *rw = ibv_reg_mr(b.pd, (void *)ro_data, sizeof(ro_data),
					       IBV_ACCESS_LOCAL_WRITE);
		int e = errno;
		CHECK(rw == NULL);
		/* The kernel's answer for pages that cannot be pinned as asked: EFAULT. */
		CHECK_EQ(e, EFAULT);
		errno = 0;
		struct ibv_mr *none = ibv_reg_mr(b.pd, (void *)0x1000, 4096, 0);
		e = errno;
		CHECK(none == NULL);
		CHECK_EQ(e, EFAULT);
		printf("  read-only data: read remotely; refused for writing; unmapped refused\n");

		/* The same range twice on one PD, and on both NICs: every MR works alone. */
		struct ibv_mr *m1 = ibv_reg_mr(b.pd, b.buf, 8192, ACC_ALL);
		struct ibv_mr *m2 = ibv_reg_mr(b.pd, b.buf, 8192, ACC_ALL);
		struct ibv_mr *m3 = ibv_reg_mr(a.pd, b.buf, 8192, ACC_ALL);
		CHECK(m1 != NULL && m2 != NULL && m3 != NULL);
		CHECK(m1->rkey != m2->rkey);
		CHECK_RET(ibv_dereg_mr(m1), 0);
		fill(a.buf, 64, 20);
		rdma(IBV_WR_RDMA_WRITE, 0, (uintptr_t)b.buf + 64, m2->rkey, 64);
		CHECK_MEM(b.buf + 64, a.buf, 64);
		CHECK_RET(ibv_dereg_mr(m2), 0);
		CHECK_RET(ibv_dereg_mr(m3), 0);

		/* Overlapping, different ranges of one buffer on the two NICs, as a program
		 * that hands parts of one pool to two devices does. */
		uint8_t *pool = malloc(1 << 16);
		CHECK(pool != NULL);
		struct ibv_mr *p0 = ibv_reg_mr(a.pd, pool, 8192, ACC_ALL);
		CHECK(p0 != NULL);
		errno = 0;
		struct ibv_mr *p1 = ibv_reg_mr(b.pd, pool + 4096, 8192, ACC_ALL);
		if (!p1)
			FAIL("ibv_reg_mr of a range overlapping one registered on the other NIC: %s",
			     strerror(errno));
		through("overlapping pool", pool + 4096, 8192, 21);
		/* The first NIC's region still reaches the same bytes. */
		fill(pool, 64, 22);
		uint8_t back[64];
		memcpy(back, pool, 64);
		memset(a.buf + 4096, 0, 64);
		struct ibv_sge sge = {
			.addr = (uintptr_t)pool, .length = 64, .lkey = p0->lkey};
		struct ibv_send_wr wr = {.wr_id = 0x77,
					 .sg_list = &sge,
					 .num_sge = 1,
					 .opcode = IBV_WR_RDMA_WRITE,
					 .send_flags = IBV_SEND_SIGNALED};
		wr.wr.rdma.remote_addr = (uintptr_t)(b.buf + 4096);
		wr.wr.rdma.rkey = b.mr->rkey;
		struct ibv_send_wr *bad = NULL;
		CHECK_RET(ibv_post_send(a.qp, &wr, &bad), 0);
		struct ibv_wc wc;
		EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE);
		CHECK_MEM(b.buf + 4096, back, 64);
		CHECK_RET(ibv_dereg_mr(p1), 0);
		CHECK_RET(ibv_dereg_mr(p0), 0);
		free(pool);

		/* Shared memory (MAP_SHARED: anonymous, as shm and fork-shared buffers are). */
		void *sh = mmap(NULL, 1 << 16, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
				-1, 0);
		CHECK(sh != MAP_FAILED);
		errno = 0;
		/* Its pages cannot be moved onto a memory file without ending their sharing: the
		 * in-process NIC reaches them in place. */
		struct ibv_mr *shm = ibv_reg_mr(b.pd, sh, 1 << 16, ACC_ALL);
		CHECK(shm != NULL);
		CHECK_RET(ibv_dereg_mr(shm), 0);
		through("MAP_SHARED anonymous", sh, 1 << 16, 22);
		CHECK_EQ(munmap(sh, 1 << 16), 0);
	}

	/* ---- bad access flags and lengths ---- */
	uint8_t small[256];
	CHECK_NULL_ERRNO(ibv_reg_mr(b.pd, small, sizeof(small), IBV_ACCESS_REMOTE_WRITE), EINVAL);
	CHECK_NULL_ERRNO(ibv_reg_mr(b.pd, small, sizeof(small), IBV_ACCESS_REMOTE_ATOMIC),
			 EINVAL);
	/* On demand is supported in-process (odp.c); a flag no access has is EINVAL. */
	CHECK_NULL_ERRNO(ibv_reg_mr(b.pd, small, sizeof(small), IBV_ACCESS_LOCAL_WRITE | (1 << 12)),
			 EINVAL);
	CHECK_NULL_ERRNO(ibv_reg_mr(b.pd, small, 0, IBV_ACCESS_LOCAL_WRITE), EINVAL);
	CHECK_NULL_ERRNO(ibv_reg_mr(NULL, small, sizeof(small), IBV_ACCESS_LOCAL_WRITE), EINVAL);
	{
		/* An optional access flag (a hint) is accepted. */
		struct ibv_mr *mr = ibv_reg_mr(
			b.pd, small, sizeof(small),
			IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING);
		CHECK(mr != NULL);
		/* Local read only is fine too. */
		struct ibv_mr *ro = ibv_reg_mr(b.pd, small, sizeof(small), 0);
		CHECK(ro != NULL);
		CHECK_RET(ibv_dereg_mr(ro), 0);
		CHECK_RET(ibv_dereg_mr(mr), 0);
	}

	/* ---- PD lifetime ---- */
	{
		struct ibv_pd *pd = ibv_alloc_pd(b.ctx);
		CHECK(pd != NULL);
		CHECK(pd->context == b.ctx);
		struct ibv_mr *mr = ibv_reg_mr(pd, small, sizeof(small), IBV_ACCESS_LOCAL_WRITE);
		CHECK(mr != NULL);
		CHECK_RET(ibv_dealloc_pd(pd), EBUSY);
		/* ibv_rereg_mr: libibverbs' checks of its arguments (ERR_INPUT), then the
		 * kernel's and the device's (ERR_CMD), errno EINVAL; the MR is unchanged. */
		uint32_t lkey = mr->lkey, rkey = mr->rkey;
		errno = 0;
		CHECK_EQ(ibv_rereg_mr(mr, 1 << 3, NULL, NULL, 0, 0), IBV_REREG_MR_ERR_INPUT);
		CHECK_EQ(errno, EINVAL);
		CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, NULL, 64, 0),
			 IBV_REREG_MR_ERR_INPUT);
		CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, small, 0, 0),
			 IBV_REREG_MR_ERR_INPUT);
		CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, pd, NULL, 0,
				      IBV_ACCESS_LOCAL_WRITE),
			 IBV_REREG_MR_ERR_INPUT);
		errno = 0;
		CHECK_EQ(ibv_rereg_mr(mr, 0, NULL, NULL, 0, 0), IBV_REREG_MR_ERR_CMD);
		CHECK_EQ(errno, EINVAL);
		errno = 0;
		CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, NULL, NULL, 0, 0),
			 IBV_REREG_MR_ERR_CMD);
		CHECK_EQ(errno, EINVAL);
		errno = 0;
		CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
				      IBV_ACCESS_REMOTE_WRITE),
			 IBV_REREG_MR_ERR_CMD);
		CHECK_EQ(errno, EINVAL);
		CHECK(mr->pd == pd && mr->addr == small && mr->length == sizeof(small));
		/* A change that is allowed: the keys stay. */
		CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
				      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ),
			 0);
		CHECK_EQ(mr->lkey, lkey);
		CHECK_EQ(mr->rkey, rkey);
		CHECK_RET(ibv_dereg_mr(mr), 0);
		CHECK_RET(ibv_dereg_mr(mr), EINVAL);
		CHECK_RET(ibv_dealloc_pd(pd), 0);
		CHECK_RET(ibv_dealloc_pd(pd), EINVAL);
		/* A dead PD registers nothing. */
		CHECK_NULL_ERRNO(ibv_reg_mr(pd, small, sizeof(small), IBV_ACCESS_LOCAL_WRITE),
				 EINVAL);
		/* A PD with a QP is busy too. */
		CHECK_RET(ibv_dealloc_pd(a.pd), EBUSY);
	}

	/* ---- ibv_rereg_mr moves a region: new buffer, other PD and back ---- */
	{
		uint8_t *x = malloc(4096), *y = malloc(8192);
		CHECK(x != NULL && y != NULL);
		memset(x, 0x5a, 4096);
		memset(y, 0, 8192);
		struct ibv_mr *mr = ibv_reg_mr(b.pd, x, 4096, ACC_ALL);
		CHECK(mr != NULL);
		uint32_t rkey = mr->rkey;
		CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, y, 8192, 0), 0);
		CHECK(mr->addr == y);
		CHECK_EQ(mr->length, 8192);
		CHECK_EQ(mr->rkey, rkey);
		/* A WRITE with the same key lands in the new buffer, past the old length. */
		fill(a.buf, 256, 31);
		rdma(IBV_WR_RDMA_WRITE, 0, (uintptr_t)y + 6000, mr->rkey, 256);
		CHECK_MEM(y + 6000, a.buf, 256);
		static uint8_t untouched[4096];
		memset(untouched, 0x5a, sizeof(untouched));
		CHECK_MEM(x, untouched, 4096);
		/* To another PD and back: the MR follows, the old PD may go. */
		struct ibv_pd *other = ibv_alloc_pd(b.ctx);
		CHECK(other != NULL);
		CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, other, NULL, 0, 0), 0);
		CHECK(mr->pd == other);
		CHECK_RET(ibv_dealloc_pd(other), EBUSY);
		CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, b.pd, NULL, 0, 0), 0);
		CHECK(mr->pd == b.pd);
		CHECK_RET(ibv_dealloc_pd(other), 0);
		/* Read-only, then writable again (the pages are checked for writing again). */
		CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
				      IBV_ACCESS_REMOTE_READ),
			 0);
		CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, ACC_ALL), 0);
		fill(a.buf, 64, 32);
		rdma(IBV_WR_RDMA_WRITE, 0, (uintptr_t)y, mr->rkey, 64);
		CHECK_MEM(y, a.buf, 64);
		CHECK_RET(ibv_dereg_mr(mr), 0);
		free(x);
		free(y);
		printf("  ibv_rereg_mr: translation, PD and access changed, keys kept\n");
	}

	/* ---- NULL pointers ---- */
	CHECK_NULL_ERRNO(ibv_alloc_pd(NULL), EINVAL);
	CHECK_RET(ibv_dealloc_pd(NULL), EINVAL);
	CHECK_RET(ibv_dereg_mr(NULL), EINVAL);
	CHECK_RET(ibv_destroy_cq(NULL), EINVAL);
	CHECK_RET(ibv_destroy_qp(NULL), EINVAL);

	/* The pair still works after all the refusals. */
	fill(a.buf, 32, 9);
	rdma(IBV_WR_RDMA_WRITE, 0, (uintptr_t)b.buf, b.mr->rkey, 32);
	CHECK_MEM(b.buf, a.buf, 32);

	side_close(&a);
	side_close(&b);
	printf("pd_mr: ok\n");
	return 0;
}
