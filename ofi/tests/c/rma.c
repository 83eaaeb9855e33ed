/* rma.c: RMA and atomics between two endpoints of one process: fi_write/read (1 byte to
 * 1 MiB, data read back and checked), v and msg forms, fi_inject_write, fi_writedata and
 * fi_inject_writedata (remote CQ data consuming a receive posted at the target), 64-bit
 * FI_SUM through fi_atomic, fi_inject_atomic and fi_fetch_atomic, FI_CSWAP through
 * fi_compare_atomic, the valid/query answers, unsupported types and operations, keys that
 * are not the target's (FI_EACCES error completions), selective completion, bad input.
 *
 * Usage: rma local|nolocal [selective]
 */
#include "ctest.h"

static struct ct_pair P;
static int local;
static char *abuf, *bbuf;
static struct fid_mr *amr, *bmr;
static uint64_t bkey;
#define BUFLEN ((size_t)(2 << 20) + 4096)
#define RADDR(off) ((uint64_t)(uintptr_t)(bbuf + (off))) /* FI_MR_VIRT_ADDR */

static void *adesc(void)
{
	return local ? fi_mr_desc(amr) : NULL;
}

static void expect_tx(void *ctx, uint64_t flags)
{
	struct fi_cq_tagged_entry e;
	if (!ct_wait(P.a.cq, &e)) {
		CHECK(!"a completion");
		return;
	}
	CHECK(e.op_context == ctx);
	CHECK_EQ(e.flags, flags);
}

static void expect_eacces(void *ctx)
{
	struct fi_cq_err_entry err;
	if (!ct_wait_err(P.a.cq, &err)) {
		CHECK(!"an error completion");
		return;
	}
	CHECK_EQ(err.err, FI_EACCES);
	CHECK(err.op_context == ctx);
}

static void write_read(void)
{
	static const size_t lens[] = { 1, 8, 236, 4096, 70000, 1 << 20 };
	for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
		size_t len = lens[i], off = 64 * i;
		ct_fill(abuf, len, 10 + i);
		memset(bbuf + off, 0, len + 1);
		CHECK_EQ(fi_write(P.a.ep, abuf, len, adesc(), P.a.peer, RADDR(off), bkey,
				  (void *)0xa1),
			 0);
		expect_tx((void *)0xa1, FI_RMA | FI_WRITE);
		CHECK(ct_same(bbuf + off, len, 10 + i));
		CHECK_EQ(bbuf[off + len], 0);
		/* Read it back into another place. */
		memset(abuf + BUFLEN / 2, 0, len);
		CHECK_EQ(fi_read(P.a.ep, abuf + BUFLEN / 2, len, adesc(), P.a.peer, RADDR(off),
				 bkey, (void *)0xa2),
			 0);
		expect_tx((void *)0xa2, FI_RMA | FI_READ);
		CHECK(ct_same(abuf + BUFLEN / 2, len, 10 + i));
	}
	/* No completion at the target (no FI_RMA_EVENT). */
	CHECK(ct_quiet(P.b.cq));
}

static void forms(void)
{
	void *d[2] = { adesc(), adesc() };
	struct iovec iov[2] = { { abuf, 100 }, { abuf + 4096, 200 } };
	struct fi_rma_iov rio = { RADDR(1000), 300, bkey };
	char *want = ct_pages(4096);

	/* writev gathers two buffers into one remote range; readv scatters it back. */
	ct_fill(abuf, 100, 20);
	ct_fill(abuf + 4096, 200, 21);
	memcpy(want, abuf, 100);
	memcpy(want + 100, abuf + 4096, 200);
	CHECK_EQ(fi_writev(P.a.ep, iov, d, 2, P.a.peer, RADDR(1000), bkey, (void *)0xa3), 0);
	expect_tx((void *)0xa3, FI_RMA | FI_WRITE);
	CHECK(memcmp(bbuf + 1000, want, 300) == 0);
	memset(abuf, 0, 100);
	memset(abuf + 4096, 0, 200);
	CHECK_EQ(fi_readv(P.a.ep, iov, d, 2, P.a.peer, RADDR(1000), bkey, (void *)0xa4), 0);
	expect_tx((void *)0xa4, FI_RMA | FI_READ);
	CHECK(memcmp(abuf, want, 100) == 0 && memcmp(abuf + 4096, want + 100, 200) == 0);

	/* writemsg / readmsg. */
	struct fi_msg_rma m = { .msg_iov = iov, .desc = d, .iov_count = 2, .addr = P.a.peer,
				.rma_iov = &rio, .rma_iov_count = 1, .context = (void *)0xa5 };
	ct_fill(abuf, 100, 22);
	ct_fill(abuf + 4096, 200, 23);
	CHECK_EQ(fi_writemsg(P.a.ep, &m, FI_COMPLETION), 0);
	expect_tx((void *)0xa5, FI_RMA | FI_WRITE);
	CHECK(ct_same(bbuf + 1000, 100, 22) && ct_same(bbuf + 1100, 200, 23));
	m.context = (void *)0xa6;
	memset(abuf, 0, 100);
	CHECK_EQ(fi_readmsg(P.a.ep, &m, FI_COMPLETION), 0);
	expect_tx((void *)0xa6, FI_RMA | FI_READ);
	CHECK(ct_same(abuf, 100, 22));

	/* More than one remote segment, less remote room than local data: -FI_EINVAL
	 * (README). */
	struct fi_rma_iov two[2] = { rio, rio };
	m.rma_iov = two;
	m.rma_iov_count = 2;
	CHECK_EQ(fi_writemsg(P.a.ep, &m, 0), -FI_EINVAL);
	rio.len = 10;
	m.rma_iov = &rio;
	m.rma_iov_count = 1;
	CHECK_EQ(fi_writemsg(P.a.ep, &m, 0), -FI_EINVAL);
	CHECK_EQ(fi_readmsg(P.a.ep, NULL, 0), -FI_EINVAL);

	/* inject_write: no completion, the buffer free on return; a read behind it on the
	 * same connection sees the data. */
	size_t inject = P.list->tx_attr->inject_size;
	ct_fill(abuf, inject, 24);
	CHECK_EQ(fi_inject_write(P.a.ep, abuf, inject, P.a.peer, RADDR(8192), bkey), 0);
	memset(abuf, 0, inject);
	CHECK_EQ(fi_read(P.a.ep, abuf + 65536, inject, adesc(), P.a.peer, RADDR(8192), bkey,
			 (void *)0xa7),
		 0);
	expect_tx((void *)0xa7, FI_RMA | FI_READ);
	CHECK(ct_same(abuf + 65536, inject, 24));
	CHECK(ct_same(bbuf + 8192, inject, 24));
	CHECK_EQ(fi_inject_write(P.a.ep, abuf, inject + 1, P.a.peer, RADDR(8192), bkey),
		 -FI_EMSGSIZE);

	/* writemsg with FI_INJECT on an endpoint without selective completion: the write
	 * still completes (fi_rma(3): only fi_inject_write suppresses the completion). */
	struct fi_cq_tagged_entry e;
	rio.len = 300;
	m.iov_count = 1; /* 100 bytes: within inject_size */
	m.context = (void *)0xaf;
	ct_fill(abuf, 100, 25);
	CHECK_EQ(fi_writemsg(P.a.ep, &m, FI_INJECT), 0);
	memset(abuf, 0, 100);
	ssize_t r = ct_read(P.a.cq, &e, NULL, 2);
	CHECK(r == 1 && e.op_context == (void *)0xaf);
	CHECK_EQ(fi_read(P.a.ep, abuf + 65536, 100, adesc(), P.a.peer, RADDR(1000), bkey,
			 (void *)0xa7),
		 0);
	expect_tx((void *)0xa7, FI_RMA | FI_READ);
	CHECK(ct_same(abuf + 65536, 100, 25));
}

static void writedata(void)
{
	struct fi_cq_tagged_entry e;
	/* The target's completion consumes a posted receive: FI_RMA|FI_REMOTE_WRITE|
	 * FI_REMOTE_CQ_DATA with the data, length 0 (README). */
	CHECK_EQ(fi_recv(P.b.ep, bbuf + BUFLEN / 2, 64, local ? fi_mr_desc(bmr) : NULL,
			 FI_ADDR_UNSPEC, (void *)0xb1),
		 0);
	ct_fill(abuf, 5000, 30);
	CHECK_EQ(fi_writedata(P.a.ep, abuf, 5000, adesc(), 0xabcd, P.a.peer, RADDR(0), bkey,
			      (void *)0xa8),
		 0);
	expect_tx((void *)0xa8, FI_RMA | FI_WRITE);
	if (ct_wait(P.b.cq, &e)) {
		CHECK(e.op_context == (void *)0xb1);
		CHECK_EQ(e.flags, FI_RMA | FI_REMOTE_WRITE | FI_REMOTE_CQ_DATA);
		CHECK_EQ(e.data, 0xabcd);
		CHECK_EQ(e.len, 0);
	} else {
		CHECK(!"the target's completion");
	}
	CHECK(ct_same(bbuf, 5000, 30));

	CHECK_EQ(fi_recv(P.b.ep, bbuf + BUFLEN / 2, 64, local ? fi_mr_desc(bmr) : NULL,
			 FI_ADDR_UNSPEC, (void *)0xb2),
		 0);
	ct_fill(abuf, 16, 31);
	CHECK_EQ(fi_inject_writedata(P.a.ep, abuf, 16, 0x5a5a, P.a.peer, RADDR(0), bkey), 0);
	if (ct_wait(P.b.cq, &e)) {
		CHECK(e.op_context == (void *)0xb2);
		CHECK_EQ(e.data, 0x5a5a);
	} else {
		CHECK(!"the target's completion");
	}
	CHECK(ct_same(bbuf, 16, 31));
	CHECK(ct_quiet(P.a.cq));
}

static void atomics(void)
{
	uint64_t *target = (uint64_t *)(void *)(bbuf + 16384);
	uint64_t *operand = (uint64_t *)(void *)(abuf + 16384);
	uint64_t *compare = operand + 1, *result = operand + 2;
	size_t count = 0;
	struct fi_atomic_attr attr = { 0 };

	/* What is valid: one 64-bit element of FI_SUM and FI_CSWAP. */
	CHECK_EQ(fi_atomicvalid(P.a.ep, FI_UINT64, FI_SUM, &count), 0);
	CHECK_EQ(count, 1);
	CHECK_EQ(fi_atomicvalid(P.a.ep, FI_INT64, FI_SUM, &count), 0);
	CHECK_EQ(fi_fetch_atomicvalid(P.a.ep, FI_UINT64, FI_SUM, &count), 0);
	CHECK_EQ(count, 1);
	CHECK_EQ(fi_compare_atomicvalid(P.a.ep, FI_UINT64, FI_CSWAP, &count), 0);
	CHECK_EQ(count, 1);
	CHECK_EQ(fi_query_atomic(P.a.dom, FI_UINT64, FI_SUM, &attr, 0), 0);
	CHECK_EQ(attr.count, 1);
	CHECK_EQ(attr.size, 8);
	CHECK_EQ(fi_query_atomic(P.a.dom, FI_UINT64, FI_CSWAP, &attr, FI_COMPARE_ATOMIC), 0);
	CHECK_EQ(fi_query_atomic(P.a.dom, FI_UINT64, FI_SUM, &attr, FI_FETCH_ATOMIC), 0);
	/* Everything else: -FI_EOPNOTSUPP (README). */
	CHECK_EQ(fi_atomicvalid(P.a.ep, FI_UINT32, FI_SUM, &count), -FI_EOPNOTSUPP);
	CHECK_EQ(fi_atomicvalid(P.a.ep, FI_DOUBLE, FI_SUM, &count), -FI_EOPNOTSUPP);
	CHECK_EQ(fi_atomicvalid(P.a.ep, FI_UINT64, FI_PROD, &count), -FI_EOPNOTSUPP);
	CHECK_EQ(fi_atomicvalid(P.a.ep, FI_UINT64, FI_CSWAP, &count), -FI_EOPNOTSUPP);
	CHECK_EQ(fi_fetch_atomicvalid(P.a.ep, FI_UINT64, FI_MIN, &count), -FI_EOPNOTSUPP);
	CHECK_EQ(fi_compare_atomicvalid(P.a.ep, FI_UINT64, FI_CSWAP_NE, &count),
		 -FI_EOPNOTSUPP);
	CHECK_EQ(fi_compare_atomicvalid(P.a.ep, FI_UINT64, FI_SUM, &count), -FI_EOPNOTSUPP);
	CHECK_EQ(fi_query_atomic(P.a.dom, FI_UINT64, FI_SUM, &attr, FI_TAGGED), -FI_EOPNOTSUPP);
	CHECK_EQ(fi_query_atomic(P.a.dom, FI_FLOAT, FI_SUM, &attr, 0), -FI_EOPNOTSUPP);

	/* FI_SUM: fi_atomic, fi_inject_atomic, fi_fetch_atomic. */
	*target = 1000;
	*operand = 5;
	CHECK_EQ(fi_atomic(P.a.ep, operand, 1, adesc(), P.a.peer, RADDR(16384), bkey, FI_UINT64,
			   FI_SUM, (void *)0xa9),
		 0);
	expect_tx((void *)0xa9, FI_ATOMIC | FI_WRITE);
	CHECK_EQ(*target, 1005);
	*operand = (uint64_t)-6;
	CHECK_EQ(fi_inject_atomic(P.a.ep, operand, 1, P.a.peer, RADDR(16384), bkey, FI_INT64,
				  FI_SUM),
		 0);
	*operand = 100;
	*result = 0;
	CHECK_EQ(fi_fetch_atomic(P.a.ep, operand, 1, adesc(), result, adesc(), P.a.peer,
				 RADDR(16384), bkey, FI_UINT64, FI_SUM, (void *)0xaa),
		 0);
	expect_tx((void *)0xaa, FI_ATOMIC | FI_READ);
	CHECK_EQ(*result, 999); /* the inject landed first: same connection, in order */
	CHECK_EQ(*target, 1099);

	/* FI_CSWAP: swapped when equal, left when not; the old value fetched each time. */
	*compare = 1099;
	*operand = 7;
	*result = 0;
	CHECK_EQ(fi_compare_atomic(P.a.ep, operand, 1, adesc(), compare, adesc(), result, adesc(),
				   P.a.peer, RADDR(16384), bkey, FI_UINT64, FI_CSWAP,
				   (void *)0xab),
		 0);
	expect_tx((void *)0xab, FI_ATOMIC | FI_READ);
	CHECK_EQ(*result, 1099);
	CHECK_EQ(*target, 7);
	*compare = 1;
	*operand = 8;
	CHECK_EQ(fi_compare_atomic(P.a.ep, operand, 1, adesc(), compare, adesc(), result, adesc(),
				   P.a.peer, RADDR(16384), bkey, FI_INT64, FI_CSWAP,
				   (void *)0xac),
		 0);
	expect_tx((void *)0xac, FI_ATOMIC | FI_READ);
	CHECK_EQ(*result, 7);
	CHECK_EQ(*target, 7);

	/* Refused: other types and operations, several elements (-FI_EMSGSIZE, fi_atomic(3)),
	 * none, a misaligned target, no result or compare buffer (-FI_EINVAL). */
	CHECK_EQ(fi_atomic(P.a.ep, operand, 1, adesc(), P.a.peer, RADDR(16384), bkey, FI_UINT32,
			   FI_SUM, NULL),
		 -FI_EOPNOTSUPP);
	CHECK_EQ(fi_atomic(P.a.ep, operand, 1, adesc(), P.a.peer, RADDR(16384), bkey, FI_UINT64,
			   FI_BOR, NULL),
		 -FI_EOPNOTSUPP);
	CHECK_EQ(fi_fetch_atomic(P.a.ep, operand, 1, adesc(), result, adesc(), P.a.peer,
				 RADDR(16384), bkey, FI_UINT64, FI_ATOMIC_READ, NULL),
		 -FI_EOPNOTSUPP);
	CHECK_EQ(fi_compare_atomic(P.a.ep, operand, 1, adesc(), compare, adesc(), result, adesc(),
				   P.a.peer, RADDR(16384), bkey, FI_UINT64, FI_MSWAP, NULL),
		 -FI_EOPNOTSUPP);
	CHECK_EQ(fi_atomic(P.a.ep, operand, 2, adesc(), P.a.peer, RADDR(16384), bkey, FI_UINT64,
			   FI_SUM, NULL),
		 -FI_EMSGSIZE);
	CHECK_EQ(fi_atomic(P.a.ep, operand, 0, adesc(), P.a.peer, RADDR(16384), bkey, FI_UINT64,
			   FI_SUM, NULL),
		 -FI_EINVAL);
	CHECK_EQ(fi_atomic(P.a.ep, operand, 1, adesc(), P.a.peer, RADDR(16388), bkey, FI_UINT64,
			   FI_SUM, NULL),
		 -FI_EINVAL);
	CHECK_EQ(fi_fetch_atomic(P.a.ep, operand, 1, adesc(), NULL, NULL, P.a.peer, RADDR(16384),
				 bkey, FI_UINT64, FI_SUM, NULL),
		 -FI_EINVAL);
	CHECK_EQ(fi_compare_atomic(P.a.ep, operand, 1, adesc(), NULL, NULL, result, adesc(),
				   P.a.peer, RADDR(16384), bkey, FI_UINT64, FI_CSWAP, NULL),
		 -FI_EINVAL);
	CHECK_EQ(fi_atomic(P.a.ep, operand, 1, adesc(), 99, RADDR(16384), bkey, FI_UINT64,
			   FI_SUM, NULL),
		 -FI_EINVAL);
	CHECK(ct_quiet(P.a.cq));
	CHECK_EQ(*target, 7);
}

static void bad_keys(void)
{
	/* A key the target does not know, and one no key of this provider can be: error
	 * completions FI_EACCES (README); the next operation reconnects and works. */
	ct_fill(abuf, 64, 40);
	CHECK_EQ(fi_write(P.a.ep, abuf, 64, adesc(), P.a.peer, RADDR(0), bkey ^ 0x5a5a00,
			  (void *)0xe1),
		 0);
	expect_eacces((void *)0xe1);
	CHECK_EQ(fi_read(P.a.ep, abuf, 64, adesc(), P.a.peer, RADDR(0), 1ull << 40,
			 (void *)0xe2),
		 0);
	expect_eacces((void *)0xe2);
	uint64_t *operand = (uint64_t *)(void *)(abuf + 16384);
	*operand = 1;
	CHECK_EQ(fi_atomic(P.a.ep, operand, 1, adesc(), P.a.peer, RADDR(16384), bkey + 1,
			   FI_UINT64, FI_SUM, (void *)0xe3),
		 0);
	expect_eacces((void *)0xe3);
	/* A key that is right but a range outside its region. */
	CHECK_EQ(fi_write(P.a.ep, abuf, 64, adesc(), P.a.peer, RADDR(BUFLEN), bkey, (void *)0xe4),
		 0);
	expect_eacces((void *)0xe4);

	memset(bbuf, 0, 64);
	CHECK_EQ(fi_write(P.a.ep, abuf, 64, adesc(), P.a.peer, RADDR(0), bkey, (void *)0xa1), 0);
	expect_tx((void *)0xa1, FI_RMA | FI_WRITE);
	CHECK(ct_same(bbuf, 64, 40));

	/* Local buffers that are not memory; AV index out of range. */
	char *gone = ct_pages(4096);
	munmap(gone, 4096);
	CHECK_EQ(fi_write(P.a.ep, gone, 64, NULL, P.a.peer, RADDR(0), bkey, NULL), -FI_EINVAL);
	CHECK_EQ(fi_read(P.a.ep, NULL, 64, NULL, P.a.peer, RADDR(0), bkey, NULL), -FI_EINVAL);
	CHECK_EQ(fi_write(P.a.ep, abuf, 64, adesc(), 99, RADDR(0), bkey, NULL), -FI_EINVAL);
	CHECK_EQ(fi_inject_write(P.a.ep, abuf, 8, FI_ADDR_UNSPEC, RADDR(0), bkey), -FI_EINVAL);
	CHECK(ct_quiet(P.a.cq));
}

static void selective(void)
{
	/* Bound with FI_SELECTIVE_COMPLETION: fi_write and fi_read report nothing, the msg
	 * forms with FI_COMPLETION do; errors always do. */
	struct iovec iov = { abuf, 128 };
	void *d = adesc();
	struct fi_rma_iov rio = { RADDR(0), 128, bkey };
	struct fi_msg_rma m = { .msg_iov = &iov, .desc = &d, .iov_count = 1, .addr = P.a.peer,
				.rma_iov = &rio, .rma_iov_count = 1, .context = (void *)0xa1 };
	ct_fill(abuf, 128, 50);
	CHECK_EQ(fi_write(P.a.ep, abuf, 128, adesc(), P.a.peer, RADDR(0), bkey, NULL), 0);
	CHECK_EQ(fi_writemsg(P.a.ep, &m, FI_COMPLETION), 0);
	expect_tx((void *)0xa1, FI_RMA | FI_WRITE);
	CHECK(ct_same(bbuf, 128, 50));
	CHECK(ct_quiet(P.a.cq));
	memset(abuf, 0, 128);
	CHECK_EQ(fi_read(P.a.ep, abuf, 128, adesc(), P.a.peer, RADDR(0), bkey, NULL), 0);
	m.context = (void *)0xa2;
	CHECK_EQ(fi_readmsg(P.a.ep, &m, FI_COMPLETION), 0);
	expect_tx((void *)0xa2, FI_RMA | FI_READ);
	CHECK(ct_same(abuf, 128, 50));
	CHECK_EQ(fi_write(P.a.ep, abuf, 8, adesc(), P.a.peer, RADDR(0), bkey + 1, (void *)0xe1),
		 0);
	expect_eacces((void *)0xe1);
	CHECK(ct_quiet(P.a.cq));
}

int main(int argc, char **argv)
{
	static char name[64];
	local = argc > 1 && strcmp(argv[1], "local") == 0;
	int sel = argc > 2 && strcmp(argv[2], "selective") == 0;
	snprintf(name, sizeof(name), "rma %s%s", local ? "local" : "nolocal",
		 sel ? " selective" : "");
	ct_name = name;

	struct ct_opts o = { .caps = FI_MSG | FI_RMA | FI_ATOMIC, .mr_local = local,
			     .bind_flags = sel ? FI_SELECTIVE_COMPLETION : 0 };
	ct_pair_open(&P, &o);
	abuf = ct_pages(BUFLEN);
	bbuf = ct_pages(BUFLEN);
	if (local)
		REQUIRE(fi_mr_reg(P.a.dom, abuf, BUFLEN, FI_READ | FI_WRITE | FI_RECV, 0, 0, 0,
				  &amr, NULL) == 0);
	REQUIRE(fi_mr_reg(P.b.dom, bbuf, BUFLEN, FI_REMOTE_READ | FI_REMOTE_WRITE | FI_RECV, 0,
			  0, 0, &bmr, NULL) == 0);
	bkey = fi_mr_key(bmr);
	if (sel) {
		selective();
	} else {
		write_read();
		forms();
		writedata();
		atomics();
		bad_keys();
	}
	if (local)
		CHECK_EQ(fi_close(&amr->fid), 0);
	CHECK_EQ(fi_close(&bmr->fid), 0);
	ct_pair_close(&P);
	return ct_summary_exit();
}
