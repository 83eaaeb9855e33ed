/* Thread domains and parent domains (ibv_alloc_td, ibv_alloc_parent_domain): a parent domain
 * stands for its PD wherever a PD goes (ibv_reg_mr, ibv_create_qp, ibv_create_srq_ex,
 * ibv_create_cq_ex with IBV_CQ_INIT_ATTR_MASK_PD); with allocators, the rings and doorbell
 * records of its queues come from them (called with the parent domain, its pd_context, a
 * size, an alignment and a resource type) and go back through free when the queue is
 * destroyed, with traffic through them; IBV_ALLOCATOR_USE_DEFAULT and a NULL return; and
 * EINVAL/EBUSY for every misuse. */
#include "common.h"
#include <sys/mman.h>

static struct side a, b;
static struct qp_opts o;

/* What the allocator was asked and gave. */
enum { MAXREC = 64 };
static struct rec {
	void *ptr;
	size_t size, align;
	uint64_t type;
} given[MAXREC];
static int ngiven, nfreed, nasked, bad_args;
static void *freed[MAXREC];
static int tag;
static void *mode; /* NULL: give; IBV_ALLOCATOR_USE_DEFAULT; or (void *)1: return NULL */
static struct ibv_pd *expect_pd;

static void *alloc_cb(struct ibv_pd *pd, void *ctx, size_t size, size_t align, uint64_t type)
{
	nasked++;
	if (pd != expect_pd || ctx != &tag)
		bad_args++;
	if (mode == IBV_ALLOCATOR_USE_DEFAULT)
		return IBV_ALLOCATOR_USE_DEFAULT;
	if (mode == (void *)1)
		return NULL;
	size_t len = (size + 4095) & ~(size_t)4095;
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED || ngiven == MAXREC)
		return NULL;
	given[ngiven++] = (struct rec){p, size, align, type};
	return p;
}

static void free_cb(struct ibv_pd *pd, void *ctx, void *ptr, uint64_t type)
{
	if (pd != expect_pd || ctx != &tag)
		bad_args++;
	int found = 0;
	for (int i = 0; i < ngiven; i++)
		if (given[i].ptr == ptr && given[i].type == type)
			found = 1;
	if (!found)
		bad_args++;
	if (nfreed < MAXREC)
		freed[nfreed++] = ptr;
}

static struct ibv_pd *parent_of(struct ibv_pd *pd, struct ibv_td *td)
{
	struct ibv_parent_domain_init_attr pa = {
		.pd = pd,
		.td = td,
		.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS |
			     IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT,
		.alloc = alloc_cb,
		.free = free_cb,
		.pd_context = &tag,
	};
	return ibv_alloc_parent_domain(pd->context, &pa);
}

static void misuse(void)
{
	struct ibv_td_init_attr ta = {0};
	struct ibv_td *td = ibv_alloc_td(a.ctx, &ta);
	CHECK(td != NULL);
	CHECK(td->context == a.ctx);
	ta.comp_mask = 1;
	CHECK_NULL_ERRNO(ibv_alloc_td(a.ctx, &ta), EINVAL);
	CHECK_NULL_ERRNO(ibv_alloc_td(a.ctx, NULL), EINVAL);
	struct ibv_parent_domain_init_attr pa = {.pd = a.pd};
	CHECK_NULL_ERRNO(ibv_alloc_parent_domain(a.ctx, NULL), EINVAL);
	pa.pd = NULL;
	CHECK_NULL_ERRNO(ibv_alloc_parent_domain(a.ctx, &pa), EINVAL);
	pa.pd = b.pd; /* another context's PD */
	CHECK_NULL_ERRNO(ibv_alloc_parent_domain(a.ctx, &pa), EINVAL);
	pa.pd = a.pd;
	pa.comp_mask = 1 << 5;
	CHECK_NULL_ERRNO(ibv_alloc_parent_domain(a.ctx, &pa), EINVAL);
	pa.comp_mask = 0;
	struct ibv_td *other = ibv_alloc_td(b.ctx, &(struct ibv_td_init_attr){0});
	CHECK(other != NULL);
	pa.td = other;
	CHECK_NULL_ERRNO(ibv_alloc_parent_domain(a.ctx, &pa), EINVAL);
	pa.td = td;
	/* Without allocators: a PD like any other. */
	struct ibv_pd *p = ibv_alloc_parent_domain(a.ctx, &pa);
	CHECK(p != NULL);
	CHECK(p->context == a.ctx);
	/* A parent domain of a parent domain is refused. */
	pa.pd = p;
	CHECK_NULL_ERRNO(ibv_alloc_parent_domain(a.ctx, &pa), EINVAL);
	/* The PD and the thread domain are in use while the parent domain lives. */
	CHECK_RET(ibv_dealloc_pd(a.pd), EBUSY);
	CHECK_RET(ibv_dealloc_td(td), EBUSY);
	struct ibv_mr *mr = ibv_reg_mr(p, a.buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr != NULL);
	CHECK(mr->pd == p);
	CHECK_RET(ibv_dealloc_pd(p), EBUSY);
	CHECK_RET(ibv_dereg_mr(mr), 0);
	/* An extended CQ names a parent domain, not a plain PD. */
	struct ibv_cq_init_attr_ex ca = {
		.cqe = 16,
		.wc_flags = IBV_WC_STANDARD_FLAGS,
		.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD,
		.parent_domain = a.pd,
	};
	CHECK_NULL_ERRNO(ibv_create_cq_ex(a.ctx, &ca), EINVAL);
	ca.parent_domain = p;
	struct ibv_cq_ex *cq = ibv_create_cq_ex(a.ctx, &ca);
	CHECK(cq != NULL);
	CHECK_RET(ibv_dealloc_pd(p), EBUSY);
	CHECK_RET(ibv_destroy_cq(ibv_cq_ex_to_cq(cq)), 0);
	CHECK_RET(ibv_dealloc_pd(p), 0);
	CHECK_RET(ibv_dealloc_pd(p), EINVAL);
	CHECK_RET(ibv_dealloc_td(td), 0);
	CHECK_RET(ibv_dealloc_td(other), 0);
	printf("  misuse: EINVAL and EBUSY where rdma-core gives them\n");
}

/* Queues of a parent domain with allocators, and traffic through them. */
static void allocators(void)
{
	struct ibv_td *td = ibv_alloc_td(a.ctx, &(struct ibv_td_init_attr){0});
	CHECK(td != NULL);
	struct ibv_pd *p = parent_of(a.pd, td);
	CHECK(p != NULL);
	expect_pd = p;
	mode = NULL;
	struct ibv_cq_init_attr_ex ca = {
		.cqe = 32,
		.wc_flags = IBV_WC_STANDARD_FLAGS,
		.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD,
		.parent_domain = p,
	};
	struct ibv_cq_ex *cqx = ibv_create_cq_ex(a.ctx, &ca);
	CHECK(cqx != NULL);
	struct ibv_srq_init_attr_ex sa = {
		.attr = {.max_wr = 16, .max_sge = 1},
		.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD,
		.srq_type = IBV_SRQT_BASIC,
		.pd = p,
	};
	struct ibv_srq *srq = ibv_create_srq_ex(a.ctx, &sa);
	CHECK(srq != NULL);
	struct ibv_mr *mr = ibv_reg_mr(p, a.buf, a.len, ACC_ALL);
	CHECK(mr != NULL);
	struct ibv_qp_init_attr qa = {
		.send_cq = ibv_cq_ex_to_cq(cqx),
		.recv_cq = ibv_cq_ex_to_cq(cqx),
		.srq = srq,
		.cap = {.max_send_wr = 8, .max_send_sge = 1, .max_inline_data = 32},
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *qp = ibv_create_qp(p, &qa);
	CHECK(qp != NULL);
	CHECK(qp->pd == p);
	/* CQ ring and doorbell, SRQ ring and doorbell, QP send ring and doorbell. */
	CHECK_EQ(ngiven, 6);
	int cqs = 0, srqs = 0, qps = 0, dbrs = 0;
	for (int i = 0; i < ngiven; i++) {
		CHECK_EQ((uintptr_t)given[i].ptr % given[i].align, 0);
		switch (given[i].type) {
		case 5: cqs++; break;
		case 4: srqs++; break;
		case 1: qps++; break;
		case 3: dbrs++; break;
		default: CHECK(!"a known resource type");
		}
	}
	CHECK(cqs == 1 && srqs == 1 && qps == 1 && dbrs == 3);
	CHECK_EQ(bad_args, 0);

	/* 40 SENDs each way through queues that hold 8 and 16: every ring laps. */
	b.qp = side_qp(&b, &o);
	qp_connect(qp, b.qp->qp_num, &b.gid, &o);
	qp_connect(b.qp, qp->qp_num, &a.gid, &o);
	struct ibv_wc wc;
	for (int i = 0; i < 40; i++) {
		post_srq_recv(srq, 100 + i, a.buf + 64 * (i % 16), 64, mr->lkey);
		fill(b.buf, 48, i);
		post_send_buf(b.qp, 200 + i, b.buf, 48, b.mr->lkey);
		EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
		EXPECT_WC(ibv_cq_ex_to_cq(cqx), &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
		CHECK_EQ(wc.wr_id, (uint64_t)(100 + i));
		CHECK_EQ(wc.byte_len, 48);
		unsigned char want[48];
		fill(want, 48, i);
		CHECK_MEM(a.buf + 64 * (i % 16), want, 48);
		post_recv(b.qp, 300 + i, b.buf + 1024, 64, b.mr->lkey);
		post_send_buf(qp, 400 + i, a.buf + 2048, 16, mr->lkey);
		EXPECT_WC(ibv_cq_ex_to_cq(cqx), &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
		EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	}
	/* Busy while its queues live; everything given back once they are destroyed. */
	CHECK_RET(ibv_dealloc_pd(p), EBUSY);
	CHECK_RET(ibv_destroy_qp(b.qp), 0);
	b.qp = NULL;
	CHECK_RET(ibv_destroy_qp(qp), 0);
	CHECK_RET(ibv_destroy_srq(srq), 0);
	CHECK_RET(ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)), 0);
	CHECK_RET(ibv_dereg_mr(mr), 0);
	CHECK_EQ(nfreed, ngiven);
	CHECK_EQ(bad_args, 0);
	CHECK_RET(ibv_dealloc_pd(p), 0);
	CHECK_RET(ibv_dealloc_td(td), 0);
	printf("  allocators: %d buffers given and given back, 40 SENDs each way\n", ngiven);
}

/* IBV_ALLOCATOR_USE_DEFAULT: the library's own memory; NULL: no queue, ENOMEM. */
static void default_and_null(void)
{
	struct ibv_pd *p = parent_of(a.pd, NULL);
	CHECK(p != NULL);
	expect_pd = p;
	int before = ngiven;
	mode = IBV_ALLOCATOR_USE_DEFAULT;
	nasked = 0;
	struct ibv_qp_init_attr qa = {
		.send_cq = a.cq,
		.recv_cq = a.cq,
		.cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *qp = ibv_create_qp(p, &qa);
	CHECK(qp != NULL);
	CHECK_EQ(nasked, 3); /* send ring, receive ring, doorbell record */
	CHECK_EQ(ngiven, before);
	CHECK_RET(ibv_destroy_qp(qp), 0);
	mode = (void *)1;
	CHECK_NULL_ERRNO(ibv_create_qp(p, &qa), ENOMEM);
	CHECK_RET(ibv_dealloc_pd(p), 0);
	mode = NULL;
	printf("  USE_DEFAULT takes the library's memory; NULL is ENOMEM\n");
}

int main(void)
{
	alarm(30);
	o = default_qp_opts();
	side_open(&a, "rb0", 1 << 16, 64);
	side_open(&b, "rb1", 1 << 16, 64);
	misuse();
	allocators();
	default_and_null();
	side_close(&a);
	side_close(&b);
	printf("parent_domain: ok\n");
	return 0;
}
