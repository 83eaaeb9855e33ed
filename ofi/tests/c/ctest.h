/* ctest.h: what the C test programs of ofi/tests/c share.
 *
 * Checks that print file:line and count passes and failures, a summary line
 * ("ctests NAME: N passed, F failed, K known provider bugs"), and the set-up of two
 * endpoints in one process: one per NIC of the provider's in-process fabric (rb0 and rb1,
 * RINGBELL_NICS=2), each with its domain, completion queue and address vector, each
 * holding the other's address. Every buffer of a side lives on pages of its own (two
 * devices in one process must not register the same page).
 *
 * Written for ringbell against libfabric 1.17's installed headers (/usr/include/rdma).
 */
#ifndef RINGBELL_CTEST_H
#define RINGBELL_CTEST_H

#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

#define CT_VERSION FI_VERSION(1, 17)

static int ct_passed, ct_failed, ct_known;

/* A condition that must hold. */
#define CHECK(cond)                                                                  \
	do {                                                                         \
		if (cond) {                                                          \
			ct_passed++;                                                 \
		} else {                                                             \
			ct_failed++;                                                 \
			fprintf(stderr, "%s:%d: FAILED: %s\n", __FILE__, __LINE__, \
				#cond);                                              \
		}                                                                    \
	} while (0)

/* Two integers that must be equal (both printed when they are not). */
#define CHECK_EQ(got, want)                                                          \
	do {                                                                         \
		long long ct_g_ = (long long)(got), ct_w_ = (long long)(want);       \
		if (ct_g_ == ct_w_) {                                                \
			ct_passed++;                                                 \
		} else {                                                             \
			ct_failed++;                                                 \
			fprintf(stderr, "%s:%d: FAILED: %s == %s: got %lld (%s), want %lld\n", \
				__FILE__, __LINE__, #got, #want, ct_g_,              \
				ct_g_ < 0 && ct_g_ > -1000 ? fi_strerror((int)-ct_g_) : "", \
				ct_w_);                                              \
		}                                                                    \
	} while (0)

/* What libfabric's man pages ask for and the provider does not do yet: not counted as a
 * failure, printed so that it is seen (and counted as fixed once it holds). */
#define KNOWN_BUG(cond, what)                                                        \
	do {                                                                         \
		if (cond) {                                                          \
			ct_passed++;                                                 \
			fprintf(stderr, "%s:%d: known bug fixed? %s: now holds: %s\n", \
				__FILE__, __LINE__, what, #cond);                    \
		} else {                                                             \
			ct_known++;                                                  \
			fprintf(stderr, "%s:%d: known provider bug: %s (%s)\n",     \
				__FILE__, __LINE__, what, #cond);                    \
		}                                                                    \
	} while (0)

/* A step that everything after it needs: stop the program if it fails. */
#define REQUIRE(cond)                                                                \
	do {                                                                         \
		int ct_ok_ = !!(cond);                                               \
		CHECK(ct_ok_ && #cond);                                              \
		if (!ct_ok_) {                                                       \
			fprintf(stderr, "%s:%d: cannot go on\n", __FILE__, __LINE__); \
			exit(ct_summary_exit());                                     \
		}                                                                    \
	} while (0)

/* A set-up step that must succeed (a negative fabric errno stops the program, exit 2). */
#define MUST(call)                                                                   \
	do {                                                                         \
		long long _r = (long long)(call);                                    \
		if (_r < 0) {                                                        \
			fprintf(stderr, "%s:%d: %s: %lld (%s)\n", __FILE__, __LINE__,   \
				#call, _r, fi_strerror((int)-_r));                   \
			exit(2);                                                     \
		}                                                                    \
	} while (0)

static const char *ct_name = "ctests";

static inline int ct_summary_exit(void)
{
	printf("ctests %s: %d passed, %d failed, %d known provider bugs\n", ct_name, ct_passed,
	       ct_failed, ct_known);
	fflush(stdout);
	return ct_failed ? 1 : 0;
}

/* `len` bytes on pages of their own, zeroed; never unmapped. */
static inline void *ct_pages(size_t len)
{
	void *p = mmap(NULL, len ? len : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
		       -1, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		exit(2);
	}
	return p;
}

static inline double ct_now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* Hints for an RDM endpoint of this provider with `caps`; FI_MR_LOCAL and the remote-key
 * bits when `mr_local`; otherwise no FI_MR_LOCAL (the provider registers itself), and the
 * remote-key bits only with RMA or atomics, which need them (no mode bit at all for
 * messages alone, as Open MPI asks). */
static inline struct fi_info *ct_hints(uint64_t caps, int mr_local)
{
	struct fi_info *h = fi_allocinfo();
	if (!h)
		exit(2);
	h->caps = caps;
	h->ep_attr->type = FI_EP_RDM;
	int remote = (caps & (FI_RMA | FI_ATOMIC)) != 0;
	h->domain_attr->mr_mode =
		mr_local ? FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY
		: remote ? FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY
			 : 0;
	h->fabric_attr->prov_name = strdup("ringbell");
	return h;
}

struct ct_side {
	struct fid_domain *dom;
	struct fid_cq *cq;
	struct fid_av *av;
	struct fid_ep *ep;
	char name[64];
	size_t namelen;
	fi_addr_t peer; /* the other side, in this side's AV */
	struct fi_info *info;
};

struct ct_pair {
	struct fi_info *list;
	struct fid_fabric *fab;
	struct ct_side a, b;
};

/* The options of ct_pair_open. */
struct ct_opts {
	uint64_t caps;
	int mr_local;
	enum fi_cq_format format; /* 0: FI_CQ_FORMAT_TAGGED */
	uint64_t bind_flags;      /* added to FI_TRANSMIT | FI_RECV */
	enum fi_av_type av_type;  /* 0: FI_AV_TABLE */
	enum fi_wait_obj wait_obj; /* of the CQs; 0: FI_WAIT_NONE */
};

/* An enabled endpoint of `info` in `d`, bound to `on` (its EQ or AV) and to `cq` for
 * both directions. */
static inline struct fid_ep *ct_ep_open(struct fid_domain *d, struct fi_info *info,
					struct fid *on, struct fid_cq *cq)
{
	struct fid_ep *ep = NULL;
	REQUIRE(fi_endpoint(d, info, &ep, NULL) == 0);
	REQUIRE(fi_ep_bind(ep, on, 0) == 0);
	REQUIRE(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV) == 0);
	REQUIRE(fi_enable(ep) == 0);
	return ep;
}

static inline void ct_side_open(struct ct_pair *p, struct ct_side *s, struct fi_info *info,
			 const struct ct_opts *o)
{
	struct fi_cq_attr cq_attr = { 0 };
	struct fi_av_attr av_attr = { 0 };
	s->info = info;
	REQUIRE(fi_domain(p->fab, info, &s->dom, NULL) == 0);
	cq_attr.format = o->format ? o->format : FI_CQ_FORMAT_TAGGED;
	cq_attr.wait_obj = o->wait_obj;
	cq_attr.size = 256;
	REQUIRE(fi_cq_open(s->dom, &cq_attr, &s->cq, NULL) == 0);
	av_attr.type = o->av_type ? o->av_type : FI_AV_TABLE;
	REQUIRE(fi_av_open(s->dom, &av_attr, &s->av, NULL) == 0);
	REQUIRE(fi_endpoint(s->dom, info, &s->ep, NULL) == 0);
	REQUIRE(fi_ep_bind(s->ep, &s->av->fid, 0) == 0);
	REQUIRE(fi_ep_bind(s->ep, &s->cq->fid, FI_TRANSMIT | FI_RECV | o->bind_flags) == 0);
	REQUIRE(fi_enable(s->ep) == 0);
	s->namelen = sizeof(s->name);
	REQUIRE(fi_getname(&s->ep->fid, s->name, &s->namelen) == 0);
}

/* The provider's fabric and two endpoints, one on rb0 and one on rb1, that know each
 * other. */
static inline void ct_pair_open(struct ct_pair *p, const struct ct_opts *o)
{
	struct fi_info *h = ct_hints(o->caps, o->mr_local);
	memset(p, 0, sizeof(*p));
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &p->list) == 0);
	fi_freeinfo(h);
	REQUIRE(p->list && p->list->next);
	REQUIRE(fi_fabric(p->list->fabric_attr, &p->fab, NULL) == 0);
	ct_side_open(p, &p->a, p->list, o);
	ct_side_open(p, &p->b, p->list->next, o);
	REQUIRE(fi_av_insert(p->a.av, p->b.name, 1, &p->a.peer, 0, NULL) == 1);
	REQUIRE(fi_av_insert(p->b.av, p->a.name, 1, &p->b.peer, 0, NULL) == 1);
}

/* A buffer of `len` bytes on pages of its own for each side of `p`; with `local`
 * (FI_MR_LOCAL) each registered in its side's domain for sends and receives, the
 * registrations in *amr and *bmr (ct_pair_bufs_close closes them). */
static inline void ct_pair_bufs(struct ct_pair *p, int local, size_t len, char **abuf,
				char **bbuf, struct fid_mr **amr, struct fid_mr **bmr)
{
	*abuf = ct_pages(len);
	*bbuf = ct_pages(len);
	if (local) {
		REQUIRE(fi_mr_reg(p->a.dom, *abuf, len, FI_SEND | FI_RECV, 0, 0, 0, amr, NULL) ==
			0);
		REQUIRE(fi_mr_reg(p->b.dom, *bbuf, len, FI_SEND | FI_RECV, 0, 0, 0, bmr, NULL) ==
			0);
	}
}

static inline void ct_pair_bufs_close(int local, struct fid_mr *amr, struct fid_mr *bmr)
{
	if (local) {
		CHECK_EQ(fi_close(&amr->fid), 0);
		CHECK_EQ(fi_close(&bmr->fid), 0);
	}
}

static inline void ct_side_close(struct ct_side *s)
{
	CHECK_EQ(fi_close(&s->ep->fid), 0);
	CHECK_EQ(fi_close(&s->av->fid), 0);
	CHECK_EQ(fi_close(&s->cq->fid), 0);
	CHECK_EQ(fi_close(&s->dom->fid), 0);
}

static inline void ct_pair_close(struct ct_pair *p)
{
	ct_side_close(&p->a);
	ct_side_close(&p->b);
	CHECK_EQ(fi_close(&p->fab->fid), 0);
	fi_freeinfo(p->list);
}

/* Reads one entry from `cq` (any format: `entry` has room for the largest), progressing
 * the whole process by polling; returns what the last fi_cq_read returned: 1, -FI_EAVAIL
 * (an error entry waits), or -FI_EAGAIN after `secs` seconds with nothing. */
static inline ssize_t ct_read(struct fid_cq *cq, void *entry, fi_addr_t *src, double secs)
{
	double end = ct_now() + secs;
	ssize_t r;
	do {
		r = src ? fi_cq_readfrom(cq, entry, 1, src) : fi_cq_read(cq, entry, 1);
		if (r != -FI_EAGAIN)
			return r;
	} while (ct_now() < end);
	return r;
}

/* Reads one tagged-format entry, expected to succeed within 30 s. */
static inline int ct_wait(struct fid_cq *cq, struct fi_cq_tagged_entry *e)
{
	ssize_t r = ct_read(cq, e, NULL, 30);
	if (r != 1) {
		fprintf(stderr, "ct_wait: fi_cq_read gave %zd (%s)\n", r,
			r < 0 ? fi_strerror((int)-r) : "");
		if (r == -FI_EAVAIL) {
			struct fi_cq_err_entry err = { 0 };
			if (fi_cq_readerr(cq, &err, 0) == 1)
				fprintf(stderr, "ct_wait: error entry err %d (%s) prov_errno %d\n",
					err.err, fi_strerror(err.err), err.prov_errno);
		}
	}
	return r == 1;
}

/* Reads a tagged receive's completion from `cq` (within 30 s, with its source) and checks
 * it: context, flags FI_RECV | FI_TAGGED | `flags`, tag, length, the data when `flags` has
 * FI_REMOTE_CQ_DATA, and the source `from`. */
static inline void ct_expect_trecv(struct fid_cq *cq, void *ctx, uint64_t tag, size_t len,
				   uint64_t flags, uint64_t data, fi_addr_t from)
{
	struct fi_cq_tagged_entry e;
	fi_addr_t src = 777;
	if (ct_read(cq, &e, &src, 30) != 1) {
		CHECK(!"a receive completion");
		return;
	}
	CHECK(e.op_context == ctx);
	CHECK_EQ(e.flags, FI_RECV | FI_TAGGED | flags);
	CHECK_EQ(e.tag, tag);
	CHECK_EQ(e.len, len);
	if (flags & FI_REMOTE_CQ_DATA)
		CHECK_EQ(e.data, data);
	CHECK_EQ(src, from);
}

/* Waits for an error entry on `cq` and reads it; 1 on success. */
static inline int ct_wait_err(struct fid_cq *cq, struct fi_cq_err_entry *err)
{
	struct fi_cq_tagged_entry e;
	ssize_t r = ct_read(cq, &e, NULL, 30);
	if (r != -FI_EAVAIL) {
		fprintf(stderr, "ct_wait_err: fi_cq_read gave %zd, not -FI_EAVAIL\n", r);
		return 0;
	}
	memset(err, 0, sizeof(*err));
	return fi_cq_readerr(cq, err, 0) == 1;
}

/* Nothing more arrives on `cq` within a short while. */
static inline int ct_quiet(struct fid_cq *cq)
{
	struct fi_cq_tagged_entry e;
	return ct_read(cq, &e, NULL, 0.2) == -FI_EAGAIN;
}

/* Fills `len` bytes with a pattern of `seed`. */
static inline void ct_fill(void *buf, size_t len, unsigned seed)
{
	unsigned char *b = buf;
	for (size_t i = 0; i < len; i++)
		b[i] = (unsigned char)(seed * 131 + i * 7 + (i >> 8));
}

/* `len` bytes at `buf` hold the pattern of `seed`. */
static inline int ct_same(const void *buf, size_t len, unsigned seed)
{
	const unsigned char *b = buf;
	for (size_t i = 0; i < len; i++)
		if (b[i] != (unsigned char)(seed * 131 + i * 7 + (i >> 8)))
			return 0;
	return 1;
}

/* Runs `fn` in a child process (a scenario that might crash the provider) and returns its
 * exit status, or 128 + the signal that ended it. Call before this process has opened
 * anything of libfabric. */
static inline int ct_in_child(int (*fn)(void))
{
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	if (pid < 0) {
		perror("fork");
		exit(2);
	}
	if (pid == 0)
		_exit(fn());
	int st = 0;
	if (waitpid(pid, &st, 0) < 0)
		return 255;
	if (WIFSIGNALED(st))
		return 128 + WTERMSIG(st);
	return WEXITSTATUS(st);
}

#endif
