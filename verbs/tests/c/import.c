/* Sharing objects between contexts (ibv_import_device(3), ibv_import_pd, ibv_import_mr,
 * ibv_import_dm and the unimport calls), within one process: a context imported from a
 * duplicate of another's cmd_fd, on the same NIC, owning and closing that descriptor; the
 * original's PD, MR and device memory found by handle and used from the imported context
 * (a QP made there on the imported PD moves data with the imported MR's keys, and the
 * imported device memory reads what the original wrote); what is refused (the context's
 * own descriptor, a descriptor of nothing, handles naming nothing: EINVAL or EBADF); and
 * an object living while any handle on it does. */
#include "common.h"
#include <fcntl.h>

static struct side a, b;

int main(void)
{
	struct qp_opts o = default_qp_opts();
	pair_open(&a, &b, 0, 1 << 16, 64, &o);

	/* ---- devices ---- */
	CHECK_NULL_ERRNO(ibv_import_device(a.ctx->cmd_fd), EINVAL);
	CHECK_NULL_ERRNO(ibv_import_device(-1), EBADF);
	int fd = dup(a.ctx->cmd_fd);
	CHECK(fd >= 0);
	struct ibv_context *ic = ibv_import_device(fd);
	CHECK(ic != NULL);
	CHECK(ic != a.ctx);
	CHECK(ic->cmd_fd == fd);
	CHECK(ic->device == a.ctx->device);
	struct ibv_device_attr da, ia;
	CHECK_RET(ibv_query_device(a.ctx, &da), 0);
	CHECK_RET(ibv_query_device(ic, &ia), 0);
	CHECK_EQ(da.node_guid, ia.node_guid);

	/* ---- PD and MR by handle ---- */
	CHECK_NULL_ERRNO(ibv_import_pd(ic, a.pd->handle + 1000), EINVAL);
	struct ibv_pd *ipd = ibv_import_pd(ic, a.pd->handle);
	CHECK(ipd != NULL);
	CHECK(ipd->context == ic);
	CHECK_EQ(ipd->handle, a.pd->handle);
	CHECK_NULL_ERRNO(ibv_import_mr(ipd, a.mr->handle ^ 0x100), EINVAL);
	/* A region of another PD of the NIC is not this PD's. */
	struct ibv_pd *other = ibv_alloc_pd(a.ctx);
	CHECK(other != NULL);
	struct ibv_mr *omr = ibv_reg_mr(other, a.buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(omr != NULL);
	CHECK_NULL_ERRNO(ibv_import_mr(ipd, omr->handle), EINVAL);
	CHECK_RET(ibv_dereg_mr(omr), 0);
	CHECK_RET(ibv_dealloc_pd(other), 0);
	struct ibv_mr *imr = ibv_import_mr(ipd, a.mr->handle);
	CHECK(imr != NULL);
	CHECK(imr->pd == ipd && imr->context == ic);
	CHECK_EQ(imr->lkey, a.mr->lkey);
	CHECK_EQ(imr->rkey, a.mr->rkey);
	CHECK_EQ(imr->length, a.mr->length);

	/* A QP of the imported context, on the imported PD, WRITEs from the imported MR's
	 * lkey into b; b WRITEs back with the imported MR's rkey. */
	struct ibv_cq *icq = ibv_create_cq(ic, 16, NULL, NULL, 0);
	CHECK(icq != NULL);
	struct side s = {.ctx = ic, .pd = ipd, .cq = icq, .mr = imr, .buf = a.buf, .len = a.len,
			 .gid = gid_of(ic)};
	struct ibv_qp *iqp = side_qp(&s, &o);
	struct ibv_qp *bqp = ibv_create_qp(b.pd, &(struct ibv_qp_init_attr){
		.send_cq = b.cq, .recv_cq = b.cq, .qp_type = IBV_QPT_RC,
		.cap = {.max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1}});
	CHECK(bqp != NULL);
	qp_connect(iqp, bqp->qp_num, &b.gid, &o);
	qp_connect(bqp, iqp->qp_num, &s.gid, &o);
	fill(a.buf, 256, 7);
	struct ibv_sge sg = {(uintptr_t)a.buf, 256, imr->lkey};
	struct ibv_send_wr w = {.wr_id = 1, .sg_list = &sg, .num_sge = 1,
				.opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED};
	w.wr.rdma.remote_addr = (uintptr_t)b.buf + 1024;
	w.wr.rdma.rkey = b.mr->rkey;
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(iqp, &w, &bad), 0);
	struct ibv_wc wc;
	EXPECT_WC(icq, &wc, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE);
	CHECK_MEM(b.buf + 1024, a.buf, 256);
	fill(b.buf + 4096, 128, 9);
	struct ibv_sge bs = {(uintptr_t)b.buf + 4096, 128, b.mr->lkey};
	w.sg_list = &bs;
	w.wr.rdma.remote_addr = (uintptr_t)a.buf + 8192;
	w.wr.rdma.rkey = imr->rkey;
	CHECK_RET(ibv_post_send(bqp, &w, &bad), 0);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE);
	CHECK_MEM(a.buf + 8192, b.buf + 4096, 128);

	/* ---- device memory ---- */
	struct ibv_alloc_dm_attr dattr = {.length = 4096};
	struct ibv_dm *dm = ibv_alloc_dm(a.ctx, &dattr);
	CHECK(dm != NULL);
	CHECK_NULL_ERRNO(ibv_import_dm(ic, dm->handle + 77), EINVAL);
	struct ibv_dm *idm = ibv_import_dm(ic, dm->handle);
	CHECK(idm != NULL);
	CHECK(idm->context == ic);
	uint8_t pat[64], got[64];
	fill(pat, sizeof(pat), 3);
	CHECK_RET(ibv_memcpy_to_dm(dm, 128, pat, sizeof(pat)), 0);
	CHECK_RET(ibv_memcpy_from_dm(got, idm, 128, sizeof(got)), 0);
	CHECK_MEM(got, pat, sizeof(pat));
	/* Freed through the original handle, it stays for the imported one. */
	CHECK_RET(ibv_free_dm(dm), 0);
	memset(got, 0, sizeof(got));
	CHECK_RET(ibv_memcpy_from_dm(got, idm, 128, sizeof(got)), 0);
	CHECK_MEM(got, pat, sizeof(pat));
	ibv_unimport_dm(idm);

	/* ---- unimport, and the original's objects go on ---- */
	CHECK_RET(ibv_destroy_qp(iqp), 0);
	CHECK_RET(ibv_destroy_qp(bqp), 0);
	CHECK_RET(ibv_destroy_cq(icq), 0);
	ibv_unimport_mr(imr);
	ibv_unimport_pd(ipd);
	CHECK_RET(ibv_close_device(ic), 0);
	/* The imported context closed its descriptor. */
	CHECK(fcntl(fd, F_GETFD) == -1 && errno == EBADF);
	post_recv(b.qp, 5, b.buf, 64, b.mr->lkey);
	post_send_buf(a.qp, 6, a.buf, 64, a.mr->lkey);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_MEM(b.buf, a.buf, 64);

	/* An MR deregistered through the original handle stays for an imported one. */
	fd = dup(a.ctx->cmd_fd);
	ic = ibv_import_device(fd);
	CHECK(ic != NULL);
	ipd = ibv_import_pd(ic, a.pd->handle);
	CHECK(ipd != NULL);
	uint8_t *extra = calloc(1, 4096);
	CHECK(extra != NULL);
	struct ibv_mr *mr2 = ibv_reg_mr(a.pd, extra, 4096, ACC_ALL);
	CHECK(mr2 != NULL);
	imr = ibv_import_mr(ipd, mr2->handle);
	CHECK(imr != NULL);
	uint32_t rkey = mr2->rkey;
	CHECK_RET(ibv_dereg_mr(mr2), 0);
	fill(b.buf + 512, 32, 11);
	struct ibv_sge s2 = {(uintptr_t)b.buf + 512, 32, b.mr->lkey};
	w.sg_list = &s2;
	w.wr.rdma.remote_addr = (uintptr_t)extra;
	w.wr.rdma.rkey = rkey;
	CHECK_RET(ibv_post_send(b.qp, &w, &bad), 0);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE);
	CHECK_MEM(extra, b.buf + 512, 32);
	/* Closing the imported context releases its handles, and with them the region. */
	CHECK_RET(ibv_close_device(ic), 0);
	CHECK_RET(ibv_post_send(b.qp, &w, &bad), 0);
	EXPECT_WC(b.cq, &wc, IBV_WC_REM_ACCESS_ERR, -1);
	free(extra);
	printf("  import: device, PD, MR and device memory by handle; unimport\n");
	return 0;
}
