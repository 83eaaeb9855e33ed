/* offload.c: who matches tagged messages. Through the provider's domain operations
 * (fi_open_ops "ringbell_domain_ops_v1", tag_counts), checks that receives posted before
 * their message are matched by the NIC's hardware list of the receiver's TM-SRQ, eager
 * and rendezvous sizes, with their bytes and remote CQ data; that messages which arrive
 * before their receive (unexpected) are matched by software; that receives the list does
 * not take (shorter than the eager limit, directed at one source) and the receives behind
 * them stay in software, in MPI order; and, with RINGBELL_TM_HW_TAGS=0 (argument
 * "software"), that software matches everything.
 *
 * Usage: offload local|nolocal [software]
 */
#include "ctest.h"

/* The provider's own domain operations (README, "ringbell_domain_ops_v1"). */
struct ringbell_tag_counts {
	uint64_t hw_posted, hw_matched, sw_matched, taken_back, sw_rndv, unexpected;
};
struct ringbell_domain_ops {
	size_t size;
	uint64_t (*clock_ps)(struct fid *domain);
	int (*cntr_arm)(struct fid_cntr *cntr, uint64_t threshold);
	int (*cntr_reached)(struct fid_cntr *cntr, uint64_t *ps);
	int (*tag_counts)(struct fid_ep *ep, struct ringbell_tag_counts *out);
};

#define EAGER_MAX 240 /* README: up to 240 bytes go eagerly */
#define BUFLEN ((size_t)(1 << 20) + 4096)

static struct ct_pair P;
static int local, software;
static char *abuf, *bbuf;
static struct fid_mr *amr, *bmr;
static struct ringbell_domain_ops *ops;
static uint64_t nic_total, sw_total;

static void *adesc(void)
{
	return local ? fi_mr_desc(amr) : NULL;
}

static void *bdesc(void)
{
	return local ? fi_mr_desc(bmr) : NULL;
}

static struct ringbell_tag_counts counts(void)
{
	struct ringbell_tag_counts c = { 0 };
	CHECK_EQ(ops->tag_counts(P.b.ep, &c), 0);
	return c;
}

static void expect_recv(void *ctx, uint64_t tag, size_t len, uint64_t data)
{
	ct_expect_trecv(P.b.cq, ctx, tag, len, FI_REMOTE_CQ_DATA, data, P.b.peer);
}

static void expect_send(void *ctx)
{
	struct fi_cq_tagged_entry e;
	if (!ct_wait(P.a.cq, &e)) {
		CHECK(!"a send completion");
		return;
	}
	CHECK(e.op_context == ctx);
}

static const size_t lens[] = { 0, 100, EAGER_MAX, EAGER_MAX + 1, 4096, 65536, 1 << 20 };
#define NLENS (sizeof(lens) / sizeof(lens[0]))

/* Receives posted first (room for the largest message): the NIC matches each. */
static void expected(void)
{
	struct ringbell_tag_counts c0 = counts();
	for (unsigned i = 0; i < NLENS; i++) {
		size_t len = lens[i];
		uint64_t tag = 0x100 + i;
		ct_fill(abuf, len, i + 1);
		memset(bbuf, 0, len + 8);
		CHECK_EQ(fi_trecv(P.b.ep, bbuf, BUFLEN, bdesc(), FI_ADDR_UNSPEC, tag, 0,
				  (void *)(uintptr_t)tag),
			 0);
		CHECK_EQ(fi_tsenddata(P.a.ep, abuf, len, adesc(), 0x5000 + i, P.a.peer, tag,
				      (void *)(uintptr_t)(tag + 1)),
			 0);
		expect_recv((void *)(uintptr_t)tag, tag, len, 0x5000 + i);
		expect_send((void *)(uintptr_t)(tag + 1));
		CHECK(ct_same(bbuf, len, i + 1));
	}
	struct ringbell_tag_counts c1 = counts();
	uint64_t nic = c1.hw_matched - c0.hw_matched, sw = c1.sw_matched - c0.sw_matched;
	printf("offload: %zu receives posted before their message: NIC matched %" PRIu64
	       ", software %" PRIu64 "\n",
	       NLENS, nic, sw);
	CHECK_EQ(nic, software ? 0 : NLENS);
	CHECK_EQ(sw, software ? NLENS : 0);
	CHECK_EQ(c1.hw_posted - c0.hw_posted, software ? 0 : NLENS);
	/* The NIC read the rendezvous messages and sent their FINs itself. */
	CHECK_EQ(c1.sw_rndv - c0.sw_rndv, software ? NLENS - 3 : 0);
	nic_total += nic;
	sw_total += sw;
}

/* Messages first, receives later: software matches them from its unexpected queue. */
static void unexpected(void)
{
	struct ringbell_tag_counts c0 = counts();
	for (unsigned i = 0; i < NLENS; i++) {
		ct_fill(abuf + i * 70000, lens[i] < 70000 ? lens[i] : 70000, i + 50);
		CHECK_EQ(fi_tsenddata(P.a.ep, abuf + i * 70000, lens[i] < 70000 ? lens[i] : 70000,
				      adesc(), 0x6000 + i, P.a.peer, 0x200 + i,
				      (void *)(uintptr_t)(0x200 + i)),
			 0);
	}
	/* Until the receiver's software has seen them all. */
	double end = ct_now() + 30;
	while (counts().unexpected - c0.unexpected < NLENS && ct_now() < end)
		;
	CHECK_EQ(counts().unexpected - c0.unexpected, NLENS);
	for (unsigned i = NLENS; i-- > 0;) {
		size_t len = lens[i] < 70000 ? lens[i] : 70000;
		memset(bbuf, 0, len + 8);
		CHECK_EQ(fi_trecv(P.b.ep, bbuf, BUFLEN, bdesc(), FI_ADDR_UNSPEC, 0x200 + i, 0,
				  (void *)(uintptr_t)i),
			 0);
		expect_recv((void *)(uintptr_t)i, 0x200 + i, len, 0x6000 + i);
		CHECK(ct_same(bbuf, len, i + 50));
	}
	for (unsigned i = 0; i < NLENS; i++) {
		struct fi_cq_tagged_entry e;
		CHECK(ct_wait(P.a.cq, &e));
	}
	struct ringbell_tag_counts c1 = counts();
	uint64_t nic = c1.hw_matched - c0.hw_matched, sw = c1.sw_matched - c0.sw_matched;
	printf("offload: %zu messages before their receive: NIC matched %" PRIu64
	       ", software %" PRIu64 "\n",
	       NLENS, nic, sw);
	CHECK_EQ(nic, 0);
	CHECK_EQ(sw, NLENS);
	CHECK_EQ(c1.unexpected, 0);
	/* Software read the rendezvous messages (those above the eager limit). */
	CHECK_EQ(c1.sw_rndv - c0.sw_rndv, NLENS - 3);
	nic_total += nic;
	sw_total += sw;
}

/* A receive shorter than the eager limit stays in software, and so does every receive
 * posted behind it; a directed receive too. MPI order holds across them. */
static void stays_in_software(void)
{
	struct ringbell_tag_counts c0 = counts();
	static char small[64];
	CHECK_EQ(fi_trecv(P.b.ep, small, sizeof(small), NULL, FI_ADDR_UNSPEC, 0x300, 0,
			  (void *)0x301),
		 0);
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, BUFLEN, bdesc(), FI_ADDR_UNSPEC, 0x300, 0,
			  (void *)0x302),
		 0);
	CHECK_EQ(counts().hw_posted, c0.hw_posted);
	ct_fill(abuf, 50, 7);
	ct_fill(abuf + 4096, 5000, 8);
	CHECK_EQ(fi_tsenddata(P.a.ep, abuf, 50, adesc(), 1, P.a.peer, 0x300, (void *)0xa1), 0);
	CHECK_EQ(fi_tsenddata(P.a.ep, abuf + 4096, 5000, adesc(), 2, P.a.peer, 0x300,
			      (void *)0xa2),
		 0);
	expect_recv((void *)0x301, 0x300, 50, 1);
	CHECK(ct_same(small, 50, 7));
	expect_recv((void *)0x302, 0x300, 5000, 2);
	CHECK(ct_same(bbuf, 5000, 8));
	expect_send((void *)0xa1);
	expect_send((void *)0xa2);
	/* Directed at A: software (the NIC has no source filter). */
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, BUFLEN, bdesc(), P.b.peer, 0x310, 0, (void *)0x311), 0);
	CHECK_EQ(fi_tsenddata(P.a.ep, abuf, 300, adesc(), 3, P.a.peer, 0x310, (void *)0xa3), 0);
	expect_recv((void *)0x311, 0x310, 300, 3);
	expect_send((void *)0xa3);
	struct ringbell_tag_counts c1 = counts();
	uint64_t nic = c1.hw_matched - c0.hw_matched, sw = c1.sw_matched - c0.sw_matched;
	printf("offload: 3 receives the list does not take: NIC matched %" PRIu64
	       ", software %" PRIu64 "\n",
	       nic, sw);
	CHECK_EQ(nic, 0);
	CHECK_EQ(sw, 3);
	CHECK_EQ(c1.hw_posted, c0.hw_posted);
	nic_total += nic;
	sw_total += sw;
}

int main(int argc, char **argv)
{
	static char name[64];
	local = argc > 1 && strcmp(argv[1], "local") == 0;
	software = argc > 2 && strcmp(argv[2], "software") == 0;
	if (software)
		setenv("RINGBELL_TM_HW_TAGS", "0", 1);
	snprintf(name, sizeof(name), "offload %s%s", local ? "local" : "nolocal",
		 software ? " software" : "");
	ct_name = name;

	struct ct_opts o = { .caps = FI_TAGGED | FI_DIRECTED_RECV, .mr_local = local };
	ct_pair_open(&P, &o);
	MUST(fi_open_ops(&P.b.dom->fid, "ringbell_domain_ops_v1", 0, (void **)&ops, NULL));
	REQUIRE(ops->size >= sizeof(*ops));
	struct ringbell_tag_counts none;
	CHECK_EQ(ops->tag_counts(NULL, &none), -FI_EINVAL);
	abuf = ct_pages(BUFLEN);
	bbuf = ct_pages(BUFLEN);
	if (local) {
		REQUIRE(fi_mr_reg(P.a.dom, abuf, BUFLEN, FI_SEND | FI_REMOTE_READ, 0, 0, 0, &amr,
				  NULL) == 0);
		REQUIRE(fi_mr_reg(P.b.dom, bbuf, BUFLEN, FI_RECV, 0, 0, 0, &bmr, NULL) == 0);
	}
	expected();
	unexpected();
	stays_in_software();
	expected();
	printf("offload: in all, NIC matched %" PRIu64 ", software %" PRIu64 "\n", nic_total,
	       sw_total);
	CHECK(ct_quiet(P.a.cq));
	CHECK(ct_quiet(P.b.cq));
	if (local) {
		CHECK_EQ(fi_close(&amr->fid), 0);
		CHECK_EQ(fi_close(&bmr->fid), 0);
	}
	ct_pair_close(&P);
	return ct_summary_exit();
}
