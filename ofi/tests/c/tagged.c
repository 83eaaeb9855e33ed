/* tagged.c: tagged messages between endpoints of one process: fi_tsend/trecv with tags
 * and ignore masks, posting and arrival order, unexpected messages, eager and rendezvous
 * sizes (0 bytes to 1 MiB), truncation (FI_ETRUNC through fi_cq_readerr), remote CQ data,
 * tinject, v and msg forms, FI_DIRECTED_RECV against a third endpoint, fi_cq_readfrom, and
 * bad input (receive buffers that are not memory, addresses out of the AV, FI_PEEK).
 *
 * Usage: tagged local|nolocal
 */
#include "ctest.h"

static struct ct_pair P;
static struct ct_side C; /* a third endpoint, on rb0 */
static int local;
static char *abuf, *bbuf, *cbuf;
static struct fid_mr *amr, *bmr, *cmr;
static fi_addr_t b_to_c; /* C in B's AV */
#define BUFLEN ((size_t)(2 << 20) + 4096)
#define EAGER_MAX 240 /* README: up to 240 bytes go eagerly */

static void *adesc(void)
{
	return local ? fi_mr_desc(amr) : NULL;
}

static void *bdesc(void)
{
	return local ? fi_mr_desc(bmr) : NULL;
}

static void *cdesc(void)
{
	return local ? fi_mr_desc(cmr) : NULL;
}

static void expect_send(struct fid_cq *cq, void *ctx)
{
	struct fi_cq_tagged_entry e;
	if (!ct_wait(cq, &e)) {
		CHECK(!"a send completion");
		return;
	}
	CHECK(e.op_context == ctx);
	CHECK_EQ(e.flags, FI_SEND | FI_TAGGED);
}

static void expect_send_msg(struct fid_cq *cq, void *ctx)
{
	struct fi_cq_tagged_entry e;
	if (!ct_wait(cq, &e)) {
		CHECK(!"a send completion");
		return;
	}
	CHECK(e.op_context == ctx);
	CHECK_EQ(e.flags, FI_SEND | FI_MSG);
}

/* fi_cq_readfrom names the sender (README). */
static void expect_recv(void *ctx, uint64_t tag, size_t len, uint64_t flags, uint64_t data,
			fi_addr_t from)
{
	ct_expect_trecv(P.b.cq, ctx, tag, len, flags, data, from);
}

/* A to B: `len` bytes tagged `tag` into a receive for `want` ignoring `ignore`. */
static void one(size_t len, uint64_t tag, uint64_t want, uint64_t ignore, int unexpected,
		unsigned seed)
{
	memset(bbuf, 0, len + 8);
	ct_fill(abuf, len, seed);
	if (!unexpected)
		CHECK_EQ(fi_trecv(P.b.ep, bbuf, len + 8, bdesc(), FI_ADDR_UNSPEC, want, ignore,
				  (void *)0xb1),
			 0);
	CHECK_EQ(fi_tsend(P.a.ep, abuf, len, adesc(), P.a.peer, tag, (void *)0xa1), 0);
	if (unexpected) {
		/* Let it arrive before the receive is posted. */
		struct fi_cq_tagged_entry e;
		CHECK(ct_read(P.b.cq, &e, NULL, 0.1) == -FI_EAGAIN);
		CHECK_EQ(fi_trecv(P.b.ep, bbuf, len + 8, bdesc(), FI_ADDR_UNSPEC, want, ignore,
				  (void *)0xb1),
			 0);
	}
	expect_recv((void *)0xb1, tag, len, 0, 0, P.b.peer);
	expect_send(P.a.cq, (void *)0xa1);
	CHECK(ct_same(bbuf, len, seed));
	CHECK_EQ(bbuf[len], 0);
}

static void sizes(void)
{
	static const size_t lens[] = { 0, 1, 100, EAGER_MAX, EAGER_MAX + 1, 4096, 65536, 1 << 20 };
	for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
		one(lens[i], 0x42 + i, 0x42 + i, 0, 0, (unsigned)i);
		one(lens[i], 0x99, 0x99, 0, 1, (unsigned)i + 50); /* unexpected */
	}
}

static void matching(void)
{
	/* Ignore mask: a receive for 0x40 ignoring the low 4 bits takes 0x4a. */
	one(10, 0x4a, 0x40, 0xf, 0, 1);
	one(200, 0x4a, 0x40, 0xf, 1, 2);
	/* Every bit ignored: any tag. */
	one(10, 0xffffffffull, 0, ~0ull, 0, 3);

	/* A message no posted receive takes waits; receives with other tags stay posted. */
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 64, bdesc(), FI_ADDR_UNSPEC, 0x100, 0, (void *)0x100), 0);
	ct_fill(abuf, 20, 4);
	CHECK_EQ(fi_tsend(P.a.ep, abuf, 20, adesc(), P.a.peer, 0x200, (void *)0xa2), 0);
	expect_send(P.a.cq, (void *)0xa2); /* eager: complete once sent */
	CHECK(ct_quiet(P.b.cq));
	CHECK_EQ(fi_trecv(P.b.ep, bbuf + 4096, 64, bdesc(), FI_ADDR_UNSPEC, 0x200, 0,
			  (void *)0x200),
		 0);
	expect_recv((void *)0x200, 0x200, 20, 0, 0, P.b.peer);
	CHECK(ct_same(bbuf + 4096, 20, 4));
	ct_fill(abuf, 30, 5);
	CHECK_EQ(fi_tsend(P.a.ep, abuf, 30, adesc(), P.a.peer, 0x100, (void *)0xa3), 0);
	expect_recv((void *)0x100, 0x100, 30, 0, 0, P.b.peer);
	expect_send(P.a.cq, (void *)0xa3);
	CHECK(ct_same(bbuf, 30, 5));

	/* Receives of one tag match in posting order, messages in arrival order. */
	for (int i = 0; i < 3; i++)
		CHECK_EQ(fi_trecv(P.b.ep, bbuf + i * 4096, 4096, bdesc(), FI_ADDR_UNSPEC, 7, 0,
				  (void *)(uintptr_t)(0x700 + i)),
			 0);
	for (int i = 0; i < 3; i++) {
		ct_fill(abuf + i * 4096, 1 + i * 1000, 60 + i);
		CHECK_EQ(fi_tsend(P.a.ep, abuf + i * 4096, 1 + i * 1000, adesc(), P.a.peer, 7,
				  NULL),
			 0);
	}
	for (int i = 0; i < 3; i++)
		expect_recv((void *)(uintptr_t)(0x700 + i), 7, 1 + i * 1000, 0, 0, P.b.peer);
	for (int i = 0; i < 3; i++) {
		expect_send(P.a.cq, NULL);
		CHECK(ct_same(bbuf + i * 4096, 1 + i * 1000, 60 + i));
	}
}

static void truncation(void)
{
	struct fi_cq_err_entry err;
	/* Eager and rendezvous: the receive fills its buffer and completes in error with
	 * FI_ETRUNC, olen the bytes cut off (fi_cq(3)); the send completes normally. */
	static const size_t lens[] = { 50, 5000, 1 << 20 };
	for (int i = 0; i < 3; i++) {
		size_t len = lens[i], room = len / 5;
		memset(bbuf, 0, len);
		ct_fill(abuf, len, 70 + i);
		CHECK_EQ(fi_trecv(P.b.ep, bbuf, room, bdesc(), FI_ADDR_UNSPEC, 0x7c, 0,
				  (void *)0xbe),
			 0);
		CHECK_EQ(fi_tsend(P.a.ep, abuf, len, adesc(), P.a.peer, 0x7c, (void *)0xae), 0);
		if (ct_wait_err(P.b.cq, &err)) {
			CHECK_EQ(err.err, FI_ETRUNC);
			CHECK(err.op_context == (void *)0xbe);
			CHECK_EQ(err.olen, len - room);
			CHECK_EQ(err.len, room);
			CHECK_EQ(err.tag, 0x7c);
			CHECK_EQ(err.flags & (FI_RECV | FI_TAGGED), FI_RECV | FI_TAGGED);
		} else {
			CHECK(!"an FI_ETRUNC error entry");
		}
		/* Nothing more on that CQ: fi_cq_readerr has taken the only error. */
		CHECK_EQ(fi_cq_readerr(P.b.cq, &err, 0), -FI_EAGAIN);
		expect_send(P.a.cq, (void *)0xae);
		CHECK(ct_same(bbuf, room, 70 + i));
		CHECK_EQ(bbuf[room], 0);
	}
}

static void data_inject_forms(void)
{
	size_t inject = P.list->tx_attr->inject_size;
	void *ad[2] = { adesc(), adesc() }, *bd[2] = { bdesc(), bdesc() };

	/* Remote CQ data, eager and rendezvous. */
	for (size_t len = 16; len <= 16384; len *= 1024) {
		ct_fill(abuf, len, 80);
		CHECK_EQ(fi_trecv(P.b.ep, bbuf, 65536, bdesc(), FI_ADDR_UNSPEC, 5, 0, (void *)0xb5),
			 0);
		CHECK_EQ(fi_tsenddata(P.a.ep, abuf, len, adesc(), 0xfeed, P.a.peer, 5, (void *)0xa5),
			 0);
		expect_recv((void *)0xb5, 5, len, FI_REMOTE_CQ_DATA, 0xfeed, P.b.peer);
		expect_send(P.a.cq, (void *)0xa5);
		CHECK(ct_same(bbuf, len, 80));
	}

	/* tinject: the buffer is free on return, no completion at the sender. */
	ct_fill(abuf, inject, 81);
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 4096, bdesc(), FI_ADDR_UNSPEC, 6, 0, (void *)0xb6), 0);
	CHECK_EQ(fi_tinject(P.a.ep, abuf, inject, P.a.peer, 6), 0);
	memset(abuf, 0, inject);
	expect_recv((void *)0xb6, 6, inject, 0, 0, P.b.peer);
	CHECK(ct_same(bbuf, inject, 81));
	ct_fill(abuf, 8, 82);
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 4096, bdesc(), FI_ADDR_UNSPEC, 6, 0, (void *)0xb6), 0);
	CHECK_EQ(fi_tinjectdata(P.a.ep, abuf, 8, 99, P.a.peer, 6), 0);
	expect_recv((void *)0xb6, 6, 8, FI_REMOTE_CQ_DATA, 99, P.b.peer);
	CHECK(ct_quiet(P.a.cq));
	CHECK_EQ(fi_tinject(P.a.ep, abuf, inject + 1, P.a.peer, 6), -FI_EMSGSIZE);
	CHECK_EQ(fi_tinjectdata(P.a.ep, abuf, inject + 1, 1, P.a.peer, 6), -FI_EMSGSIZE);

	/* tsendv/trecvv: two buffers each way (gathered, then scattered in order). */
	struct iovec siov[2] = { { abuf, 3000 }, { abuf + 8192, 3000 } };
	struct iovec riov[2] = { { bbuf, 1000 }, { bbuf + 8192, 5000 } };
	char *want = ct_pages(8192);
	ct_fill(abuf, 3000, 83);
	ct_fill(abuf + 8192, 3000, 84);
	memcpy(want, abuf, 3000);
	memcpy(want + 3000, abuf + 8192, 3000);
	CHECK_EQ(fi_trecvv(P.b.ep, riov, bd, 2, FI_ADDR_UNSPEC, 8, 0, (void *)0xb8), 0);
	CHECK_EQ(fi_tsendv(P.a.ep, siov, ad, 2, P.a.peer, 8, (void *)0xa8), 0);
	expect_recv((void *)0xb8, 8, 6000, 0, 0, P.b.peer);
	expect_send(P.a.cq, (void *)0xa8);
	CHECK(memcmp(bbuf, want, 1000) == 0);
	CHECK(memcmp(bbuf + 8192, want + 1000, 5000) == 0);

	/* tsendmsg with data, trecvmsg with a mask. */
	struct fi_msg_tagged sm = { .msg_iov = siov, .desc = ad, .iov_count = 1,
				    .addr = P.a.peer, .tag = 0x91, .context = (void *)0xa9,
				    .data = 5 };
	struct fi_msg_tagged rm = { .msg_iov = riov + 1, .desc = bd, .iov_count = 1,
				    .addr = FI_ADDR_UNSPEC, .tag = 0x90, .ignore = 0xf,
				    .context = (void *)0xb9 };
	CHECK_EQ(fi_trecvmsg(P.b.ep, &rm, FI_COMPLETION), 0);
	CHECK_EQ(fi_tsendmsg(P.a.ep, &sm, FI_REMOTE_CQ_DATA | FI_COMPLETION), 0);
	expect_recv((void *)0xb9, 0x91, 3000, FI_REMOTE_CQ_DATA, 5, P.b.peer);
	expect_send(P.a.cq, (void *)0xa9);
	CHECK(memcmp(bbuf + 8192, want, 3000) == 0);

	/* FI_PEEK with nothing there: an FI_ENOMSG error entry; FI_CLAIM of a context that
	 * claimed nothing, and FI_DISCARD alone: -FI_EINVAL (trigger.c has the rest). */
	CHECK_EQ(fi_trecvmsg(P.b.ep, &rm, FI_PEEK), 0);
	{
		struct fi_cq_err_entry err;
		CHECK(ct_wait_err(P.b.cq, &err));
		CHECK_EQ(err.err, FI_ENOMSG);
	}
	CHECK_EQ(fi_trecvmsg(P.b.ep, &rm, FI_CLAIM), -FI_EINVAL);
	CHECK_EQ(fi_trecvmsg(P.b.ep, &rm, FI_DISCARD), -FI_EINVAL);

	/* tsendmsg with FI_INJECT: the buffer is free on return and, the endpoint not being
	 * selective, the send still completes (fi_tagged(3): only fi_tinject suppresses it). */
	struct fi_cq_tagged_entry e;
	rm.context = (void *)0xba;
	sm.context = (void *)0xaa;
	CHECK_EQ(fi_trecvmsg(P.b.ep, &rm, 0), 0);
	ct_fill(abuf, 100, 85);
	siov[0].iov_len = 100;
	CHECK_EQ(fi_tsendmsg(P.a.ep, &sm, FI_INJECT), 0);
	memset(abuf, 0, 100);
	expect_recv((void *)0xba, 0x91, 100, 0, 0, P.b.peer);
	CHECK(ct_same(bbuf + 8192, 100, 85));
	ssize_t r = ct_read(P.a.cq, &e, NULL, 2);
	CHECK(r == 1 && e.op_context == (void *)0xaa);

	/* Zero bytes from and into no buffer at all. */
	CHECK_EQ(fi_trecv(P.b.ep, NULL, 0, NULL, FI_ADDR_UNSPEC, 0x33, 0, (void *)0xbb), 0);
	CHECK_EQ(fi_tsend(P.a.ep, NULL, 0, NULL, P.a.peer, 0x33, (void *)0xab), 0);
	expect_recv((void *)0xbb, 0x33, 0, 0, 0, P.b.peer);
	expect_send(P.a.cq, (void *)0xab);
	CHECK_EQ(fi_trecv(P.b.ep, NULL, 0, NULL, FI_ADDR_UNSPEC, 0x33, 0, (void *)0xbc), 0);
	CHECK_EQ(fi_tinject(P.a.ep, NULL, 0, P.a.peer, 0x33), 0);
	expect_recv((void *)0xbc, 0x33, 0, 0, 0, P.b.peer);
}

static void directed(void)
{
	/* B takes tag 3 from A only, then from anyone (FI_ADDR_UNSPEC); C sends first. */
	ct_fill(cbuf, 40, 90);
	ct_fill(abuf, 41, 91);
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 4096, bdesc(), P.b.peer, 3, 0, (void *)0xd1), 0);
	CHECK_EQ(fi_tsend(C.ep, cbuf, 40, cdesc(), C.peer, 3, (void *)0xc1), 0);
	expect_send(C.cq, (void *)0xc1);
	CHECK(ct_quiet(P.b.cq)); /* C's message does not match the directed receive */
	CHECK_EQ(fi_tsend(P.a.ep, abuf, 41, adesc(), P.a.peer, 3, (void *)0xa1), 0);
	expect_recv((void *)0xd1, 3, 41, 0, 0, P.b.peer);
	expect_send(P.a.cq, (void *)0xa1);
	CHECK(ct_same(bbuf, 41, 91));
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 4096, bdesc(), FI_ADDR_UNSPEC, 3, 0, (void *)0xd2), 0);
	expect_recv((void *)0xd2, 3, 40, 0, 0, b_to_c);
	CHECK(ct_same(bbuf, 40, 90));

	/* A receive directed at C, a rendezvous message from A first. */
	ct_fill(abuf, 9000, 92);
	ct_fill(cbuf, 9001, 93);
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 65536, bdesc(), b_to_c, 4, 0, (void *)0xd3), 0);
	CHECK_EQ(fi_tsend(P.a.ep, abuf, 9000, adesc(), P.a.peer, 4, (void *)0xa2), 0);
	CHECK(ct_quiet(P.b.cq));
	CHECK_EQ(fi_tsend(C.ep, cbuf, 9001, cdesc(), C.peer, 4, (void *)0xc2), 0);
	expect_recv((void *)0xd3, 4, 9001, 0, 0, b_to_c);
	expect_send(C.cq, (void *)0xc2);
	CHECK(ct_same(bbuf, 9001, 93));
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 65536, bdesc(), P.b.peer, 4, 0, (void *)0xd4), 0);
	expect_recv((void *)0xd4, 4, 9000, 0, 0, P.b.peer);
	expect_send(P.a.cq, (void *)0xa2);
	CHECK(ct_same(bbuf, 9000, 92));

	/* FI_DIRECTED_RECV applies to untagged receives too (fi_getinfo(3), fi_msg(3): the
	 * src_addr of fi_recv filters when the endpoint has it): a receive for A's messages
	 * must not take C's. */
	memset(bbuf, 0, 64);
	ct_fill(cbuf, 20, 94);
	ct_fill(abuf, 21, 95);
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 64, bdesc(), P.b.peer, (void *)0xf1), 0);
	CHECK_EQ(fi_send(C.ep, cbuf, 20, cdesc(), C.peer, (void *)0xc3), 0);
	expect_send_msg(C.cq, (void *)0xc3);
	struct fi_cq_tagged_entry e;
	ssize_t r = ct_read(P.b.cq, &e, NULL, 0.5);
	KNOWN_BUG(r == -FI_EAGAIN,
		  "fi_recv with a source address on an FI_DIRECTED_RECV endpoint takes a message "
		  "from another peer (the source of untagged receives is ignored)");
	/* Whatever happened, one receive per message so both are consumed. */
	CHECK_EQ(fi_recv(P.b.ep, bbuf + 4096, 64, bdesc(), FI_ADDR_UNSPEC, (void *)0xf2), 0);
	CHECK_EQ(fi_send(P.a.ep, abuf, 21, adesc(), P.a.peer, (void *)0xa4), 0);
	expect_send_msg(P.a.cq, (void *)0xa4);
	for (int i = r == 1 ? 1 : 0; i < 2; i++)
		CHECK_EQ(ct_read(P.b.cq, &e, NULL, 30), 1);
	CHECK(ct_quiet(P.b.cq));

	/* Two endpoints of one NIC (A and C on rb0), rendezvous and eager. */
	fi_addr_t a_to_c;
	REQUIRE(fi_av_insert(P.a.av, C.name, 1, &a_to_c, 0, NULL) == 1);
	for (size_t len = 100; len <= 100000; len *= 1000) {
		ct_fill(abuf, len, 96);
		memset(cbuf, 0, len);
		CHECK_EQ(fi_trecv(C.ep, cbuf, len, cdesc(), FI_ADDR_UNSPEC, 9, 0, (void *)0xc9), 0);
		CHECK_EQ(fi_tsend(P.a.ep, abuf, len, adesc(), a_to_c, 9, (void *)0xa9), 0);
		if (ct_wait(C.cq, &e)) {
			CHECK(e.op_context == (void *)0xc9);
			CHECK_EQ(e.len, len);
		} else {
			CHECK(!"the receive on the same NIC");
		}
		expect_send(P.a.cq, (void *)0xa9);
		CHECK(ct_same(cbuf, len, 96));
	}

	/* A directed receive from an address not in the AV. */
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 64, bdesc(), 4242, 4, 0, NULL), -FI_EINVAL);
}

/* Many messages before any receive (the unexpected queue), eager and rendezvous, then
 * received newest first by tag: each once, with its bytes. */
static void many_unexpected(void)
{
	static const struct {
		int n;
		size_t len;
	} runs[] = { { 2000, 64 }, { 40, 20000 } };
	struct fi_cq_tagged_entry e;
	for (int k = 0; k < 2; k++) {
		int n = runs[k].n, completed = 0, bad = 0;
		size_t len = runs[k].len;
		for (int i = 0; i < n; i++) {
			char *b = abuf + (size_t)i * len;
			ct_fill(b, len, (unsigned)i + 1000 * k);
			ssize_t r;
			while ((r = fi_tsend(P.a.ep, b, len, adesc(), P.a.peer, 0x10000 + i,
					     NULL)) == -FI_EAGAIN) {
				if (fi_cq_read(P.a.cq, &e, 1) == 1)
					completed++;
				fi_cq_read(P.b.cq, &e, 0);
			}
			if (r) {
				CHECK_EQ(r, 0);
				return;
			}
		}
		/* Eager sends complete on their own; let them (the receiver progresses too). */
		double end = ct_now() + 30;
		while (len <= EAGER_MAX && completed < n && ct_now() < end)
			if (fi_cq_read(P.a.cq, &e, 1) == 1)
				completed++;
		for (int i = n - 1; i >= 0; i--) {
			char *b = bbuf + (size_t)i * len;
			memset(b, 0, len);
			if (fi_trecv(P.b.ep, b, len, bdesc(), FI_ADDR_UNSPEC, 0x10000 + i, 0,
				     (void *)(uintptr_t)i) != 0 ||
			    ct_read(P.b.cq, &e, NULL, 30) != 1 || e.op_context != (void *)(uintptr_t)i ||
			    e.tag != (uint64_t)(0x10000 + i) || e.len != len ||
			    !ct_same(b, len, (unsigned)i + 1000 * k))
				bad++;
		}
		end = ct_now() + 30;
		while (completed < n && ct_now() < end)
			if (fi_cq_read(P.a.cq, &e, 1) == 1)
				completed++;
		CHECK_EQ(bad, 0);
		CHECK_EQ(completed, n);
	}
	CHECK(ct_quiet(P.a.cq));
	CHECK(ct_quiet(P.b.cq));
}

static void bad_input(void)
{
	uint64_t junk[8] = { 0 };
	char *gone = ct_pages(8192);
	munmap(gone, 8192);
	/* A tagged receive with a bad buffer: NULL, not mapped, a descriptor that is not a
	 * region. Refused when posted (-FI_EINVAL), nothing posted. */
	CHECK_EQ(fi_trecv(P.b.ep, NULL, 64, NULL, FI_ADDR_UNSPEC, 1, 0, NULL), -FI_EINVAL);
	CHECK_EQ(fi_trecv(P.b.ep, gone, 8192, NULL, FI_ADDR_UNSPEC, 1, 0, NULL), -FI_EINVAL);
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 64, junk, FI_ADDR_UNSPEC, 1, 0, NULL), -FI_EINVAL);
	struct iovec g = { gone, 100 };
	CHECK_EQ(fi_trecvv(P.b.ep, &g, NULL, 1, FI_ADDR_UNSPEC, 1, 0, NULL), -FI_EINVAL);
	CHECK_EQ(fi_trecvmsg(P.b.ep, NULL, 0), -FI_EINVAL);
	/* A rendezvous send from memory that is not mapped; a bad descriptor. */
	CHECK_EQ(fi_tsend(P.a.ep, gone, 8192, NULL, P.a.peer, 1, NULL), -FI_EINVAL);
	CHECK_EQ(fi_tsend(P.a.ep, abuf, 8192, junk, P.a.peer, 1, NULL), -FI_EINVAL);
	/* AV index out of range. */
	CHECK_EQ(fi_tsend(P.a.ep, abuf, 8, adesc(), 99, 1, NULL), -FI_EINVAL);
	CHECK_EQ(fi_tinject(P.a.ep, abuf, 8, 99, 1), -FI_EINVAL);
	CHECK_EQ(fi_tsenddata(P.a.ep, abuf, 8, adesc(), 1, FI_ADDR_UNSPEC, 1, NULL), -FI_EINVAL);
	CHECK_EQ(fi_tsendmsg(P.a.ep, NULL, 0), -FI_EINVAL);
	/* fi_cancel of a posted tagged receive (as MPI_Cancel does): 0, and the receive
	 * completes in error FI_ECANCELED (fi_endpoint(3)). */
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 64, bdesc(), FI_ADDR_UNSPEC, 0xcc, 0, (void *)0xcc), 0);
	ssize_t c = fi_cancel(&P.b.ep->fid, (void *)0xcc);
	struct fi_cq_err_entry err = { 0 };
	int cancelled = c == 0 && ct_wait_err(P.b.cq, &err) && err.err == FI_ECANCELED &&
			err.op_context == (void *)0xcc;
	if (!cancelled)
		fprintf(stderr, "tagged.c: fi_cancel gave %zd\n", c);
	CHECK(cancelled);
	/* None of these left anything behind: a message tagged 1 still goes to a good
	 * receive, and no completion of them comes. */
	one(10, 1, 1, 0, 0, 99);
	CHECK(ct_quiet(P.a.cq));
	CHECK(ct_quiet(P.b.cq));
}

/* An endpoint that sends and closes at once, without reading its completions: closing
 * waits for its sends to go out and complete (their connection is still to be made), so
 * the receiver gets both the eager and the rendezvous message. */
static void close_after_send(void)
{
	struct ct_side d;
	struct ct_opts o = { .caps = FI_MSG | FI_TAGGED | FI_DIRECTED_RECV, .mr_local = local };
	struct fid_mr *dmr = NULL;
	fi_addr_t b_to_d;
	char *dbuf = ct_pages(BUFLEN);
	ct_side_open(&P, &d, P.list, &o);
	REQUIRE(fi_av_insert(d.av, P.b.name, 1, &d.peer, 0, NULL) == 1);
	REQUIRE(fi_av_insert(P.b.av, d.name, 1, &b_to_d, 0, NULL) == 1);
	if (local)
		REQUIRE(fi_mr_reg(d.dom, dbuf, BUFLEN, FI_SEND | FI_REMOTE_READ, 0, 0, 0, &dmr,
				  NULL) == 0);
	ct_fill(dbuf, 100, 70);
	ct_fill(dbuf + 65536, 20000, 71);
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 4096, bdesc(), FI_ADDR_UNSPEC, 8, 0, (void *)0xe1), 0);
	CHECK_EQ(fi_trecv(P.b.ep, bbuf + 65536, 65536, bdesc(), FI_ADDR_UNSPEC, 9, 0,
			  (void *)0xe2),
		 0);
	void *dd = dmr ? fi_mr_desc(dmr) : NULL;
	CHECK_EQ(fi_tsend(d.ep, dbuf, 100, dd, d.peer, 8, (void *)0xf1), 0);
	CHECK_EQ(fi_tsend(d.ep, dbuf + 65536, 20000, dd, d.peer, 9, (void *)0xf2), 0);
	CHECK_EQ(fi_close(&d.ep->fid), 0);
	expect_recv((void *)0xe1, 8, 100, 0, 0, b_to_d);
	expect_recv((void *)0xe2, 9, 20000, 0, 0, b_to_d);
	CHECK(ct_same(bbuf, 100, 70));
	CHECK(ct_same(bbuf + 65536, 20000, 71));
	if (dmr)
		CHECK_EQ(fi_close(&dmr->fid), 0);
	CHECK_EQ(fi_close(&d.av->fid), 0);
	CHECK_EQ(fi_close(&d.cq->fid), 0);
	CHECK_EQ(fi_close(&d.dom->fid), 0);
}

int main(int argc, char **argv)
{
	static char name[64];
	local = argc > 1 && strcmp(argv[1], "local") == 0;
	snprintf(name, sizeof(name), "tagged %s", local ? "local" : "nolocal");
	ct_name = name;

	struct ct_opts o = { .caps = FI_MSG | FI_TAGGED | FI_DIRECTED_RECV, .mr_local = local };
	ct_pair_open(&P, &o);
	CHECK(P.list->caps & FI_DIRECTED_RECV);
	ct_side_open(&P, &C, P.list, &o);
	REQUIRE(fi_av_insert(C.av, P.b.name, 1, &C.peer, 0, NULL) == 1);
	REQUIRE(fi_av_insert(P.b.av, C.name, 1, &b_to_c, 0, NULL) == 1);
	abuf = ct_pages(BUFLEN);
	bbuf = ct_pages(BUFLEN);
	cbuf = ct_pages(BUFLEN);
	if (local) {
		REQUIRE(fi_mr_reg(P.a.dom, abuf, BUFLEN, FI_SEND | FI_RECV | FI_REMOTE_READ, 0, 0,
				  0, &amr, NULL) == 0);
		REQUIRE(fi_mr_reg(P.b.dom, bbuf, BUFLEN, FI_SEND | FI_RECV, 0, 0, 0, &bmr, NULL) ==
			0);
		REQUIRE(fi_mr_reg(C.dom, cbuf, BUFLEN, FI_SEND | FI_REMOTE_READ, 0, 0, 0, &cmr,
				  NULL) == 0);
	}
	sizes();
	matching();
	truncation();
	data_inject_forms();
	directed();
	many_unexpected();
	close_after_send();
	bad_input();
	if (local) {
		CHECK_EQ(fi_close(&amr->fid), 0);
		CHECK_EQ(fi_close(&bmr->fid), 0);
		CHECK_EQ(fi_close(&cmr->fid), 0);
	}
	ct_side_close(&C);
	ct_pair_close(&P);
	return ct_summary_exit();
}
