/* An allreduce (sum of one u64 per rank) built only from deferred work (fi_trigger(3),
 * FI_QUEUE_WORK) and run by the NICs: N ranks of one process, each on its own NIC of the
 * in-process fabric (RINGBELL_NICS=N), on the binomial tree of rank 0. Up the tree, a rank
 * whose children have all added into its word (its region's FI_REMOTE_WRITE counter) adds
 * its word into its parent's with a fetching atomic whose operand is read when it fires;
 * down the tree, a rank that holds the total writes it into its children's words. After the
 * set-up, the host only starts each rank (one fi_cntr_add) and watches the counters.
 *
 * The simulated latency, from the starts to the last rank holding the total and its own
 * transfers complete, comes from the device clock and the times the devices note when armed
 * counters reach their thresholds, through the provider's domain ops (fi_open_ops
 * "ringbell_domain_ops_v1"). Prints "allreduce: N ranks, R rounds, latency X us (simulated,
 * mean)" and the summary line of ctest.h. */
#include "ctest.h"

#include <rdma/fi_trigger.h>

#define MAXR 64
#define ROUNDS 3

/* The provider's own domain operations (fi_open_ops "ringbell_domain_ops_v1"). */
struct ringbell_domain_ops {
	size_t size;
	uint64_t (*clock_ps)(struct fid *domain);
	int (*cntr_arm)(struct fid_cntr *cntr, uint64_t threshold);
	int (*cntr_reached)(struct fid_cntr *cntr, uint64_t *ps);
};

struct rank {
	struct fid_domain *dom;
	struct fid_cq *cq;
	struct fid_av *av;
	struct fid_ep *ep;
	struct fid_mr *mr;
	struct fid_cntr *arrivals, *done;
	uint64_t *word;   /* the value reduced here (registered for peers) */
	uint64_t *result; /* fetched values (never read) */
	fi_addr_t addr[MAXR];
	char name[64];
	size_t namelen;
	/* Deferred work and its operations; they must live until they complete. */
	struct fi_deferred_work work[8];
	struct fi_op_fetch_atomic up;
	struct fi_op_rma down[8];
	struct fi_ioc oioc, rioc;
	struct fi_rma_ioc aioc;
	struct iovec diov;
	struct fi_rma_iov driov[8];
	int nwork;
	uint64_t final; /* arrivals once the total is here */
};

static struct rank R[MAXR];
static int n;

static int parent(int r) { return r & (r - 1); }

/* The children of r on the binomial tree of rank 0: r + 2^i below r's lowest set bit. */
static int children(int r, int *out)
{
	int c = 0;
	for (int b = 1; b < n; b <<= 1) {
		if (r != 0 && b >= (r & -r))
			break;
		if (r + b < n)
			out[c++] = r + b;
	}
	return c;
}

static void *pages(size_t len) { return ct_pages(len); }

/* Queues rank r's part of one round whose counters start at `base` arrivals. */
static void arm(int r, uint64_t base)
{
	struct rank *x = &R[r];
	int ch[MAXR], c = children(r, ch);
	uint64_t reduced = base + c + 1; /* the children's atomics and the start */
	x->nwork = 0;
	if (r != 0) {
		int p = parent(r);
		x->oioc = (struct fi_ioc){.addr = x->word, .count = 1};
		x->rioc = (struct fi_ioc){.addr = x->result, .count = 1};
		x->aioc = (struct fi_rma_ioc){.addr = (uint64_t)(uintptr_t)R[p].word, .count = 1,
					      .key = fi_mr_key(R[p].mr)};
		x->up = (struct fi_op_fetch_atomic){
			.ep = x->ep,
			.msg = {.msg_iov = &x->oioc, .iov_count = 1, .addr = x->addr[p],
				.rma_iov = &x->aioc, .rma_iov_count = 1, .datatype = FI_UINT64,
				.op = FI_SUM},
			.fetch = {.msg_iov = &x->rioc, .iov_count = 1}};
		struct fi_deferred_work *w = &x->work[x->nwork++];
		*w = (struct fi_deferred_work){.threshold = reduced, .triggering_cntr = x->arrivals,
					       .completion_cntr = x->done,
					       .op_type = FI_OP_FETCH_ATOMIC};
		w->op.fetch_atomic = &x->up;
		MUST(fi_control(&x->dom->fid, FI_QUEUE_WORK, w));
	}
	uint64_t down = reduced + (r != 0); /* and the total written by the parent */
	x->final = down;
	x->diov = (struct iovec){.iov_base = x->word, .iov_len = 8};
	for (int i = 0; i < c; i++) {
		x->driov[i] = (struct fi_rma_iov){.addr = (uint64_t)(uintptr_t)R[ch[i]].word,
						  .len = 8, .key = fi_mr_key(R[ch[i]].mr)};
		x->down[i] = (struct fi_op_rma){
			.ep = x->ep,
			.msg = {.msg_iov = &x->diov, .iov_count = 1, .addr = x->addr[ch[i]],
				.rma_iov = &x->driov[i], .rma_iov_count = 1}};
		struct fi_deferred_work *w = &x->work[x->nwork++];
		*w = (struct fi_deferred_work){.threshold = down, .triggering_cntr = x->arrivals,
					       .completion_cntr = x->done, .op_type = FI_OP_WRITE};
		w->op.rma = &x->down[i];
		MUST(fi_control(&x->dom->fid, FI_QUEUE_WORK, w));
	}
}

int main(int argc, char **argv)
{
	n = argc > 1 ? atoi(argv[1]) : 8;
	if (n < 2 || n > MAXR)
		return 2;
	struct fi_info *hints = fi_allocinfo(), *list, *info;
	hints->caps = FI_MSG | FI_RMA | FI_ATOMIC | FI_TRIGGER | FI_RMA_EVENT;
	hints->ep_attr->type = FI_EP_RDM;
	hints->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
	MUST(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &list));
	struct fid_fabric *fabric;
	MUST(fi_fabric(list->fabric_attr, &fabric, NULL));
	info = list;
	for (int r = 0; r < n; r++, info = info->next) {
		struct rank *x = &R[r];
		if (!info) {
			fprintf(stderr, "fewer than %d NICs (set RINGBELL_NICS)\n", n);
			return 2;
		}
		struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_TAGGED, .size = 256};
		struct fi_av_attr ava = {.type = FI_AV_TABLE};
		struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_UNSPEC};
		MUST(fi_domain(fabric, info, &x->dom, NULL));
		MUST(fi_cq_open(x->dom, &cqa, &x->cq, NULL));
		MUST(fi_av_open(x->dom, &ava, &x->av, NULL));
		MUST(fi_endpoint(x->dom, info, &x->ep, NULL));
		MUST(fi_ep_bind(x->ep, &x->av->fid, 0));
		MUST(fi_ep_bind(x->ep, &x->cq->fid, FI_TRANSMIT | FI_RECV));
		MUST(fi_enable(x->ep));
		MUST(fi_cntr_open(x->dom, &ca, &x->arrivals, NULL));
		MUST(fi_cntr_open(x->dom, &ca, &x->done, NULL));
		char *page = pages(4096);
		x->word = (uint64_t *)page;
		x->result = (uint64_t *)(page + 64);
		MUST(fi_mr_reg(x->dom, x->word, 8, FI_REMOTE_WRITE | FI_REMOTE_READ, 0, 0, 0, &x->mr,
			       NULL));
		MUST(fi_mr_bind(x->mr, &x->arrivals->fid, FI_REMOTE_WRITE));
		x->namelen = sizeof(x->name);
		MUST(fi_getname(&x->ep->fid, x->name, &x->namelen));
	}
	for (int r = 0; r < n; r++)
		for (int p = 0; p < n; p++)
			MUST(fi_av_insert(R[r].av, R[p].name, 1, &R[r].addr[p], 0, NULL));
	struct ringbell_domain_ops *ops;
	MUST(fi_open_ops(&R[0].dom->fid, "ringbell_domain_ops_v1", 0, (void **)&ops, NULL));

	/* Connections along the tree first (one message from each child to its parent), so
	 * that the rounds time the collective alone. */
	static char buf[MAXR][64];
	struct fi_cq_tagged_entry e;
	for (int r = 1; r < n; r++)
		MUST(fi_recv(R[parent(r)].ep, buf[r], 64, NULL, FI_ADDR_UNSPEC, NULL));
	for (int r = 1; r < n; r++)
		MUST(fi_send(R[r].ep, "hi", 3, NULL, R[r].addr[parent(r)], NULL));
	for (int got = 0; got < 2 * (n - 1);)
		for (int r = 0; r < n; r++)
			while (fi_cq_read(R[r].cq, &e, 1) == 1)
				got++;

	uint64_t total_ps = 0;
	for (int round = 0; round < ROUNDS; round++) {
		uint64_t expect = 0, ops_done[MAXR];
		for (int r = 0; r < n; r++) {
			*R[r].word = (uint64_t)(r + 1) * 1000 + round;
			expect += *R[r].word;
			uint64_t base = fi_cntr_read(R[r].arrivals);
			ops_done[r] = fi_cntr_read(R[r].done);
			arm(r, base);
			ops_done[r] += R[r].nwork;
		}
		/* Completion is timed by the devices: each rank's counters armed at their final
		 * values before the start. */
		for (int r = 0; r < n; r++) {
			MUST(ops->cntr_arm(R[r].done, ops_done[r]));
			MUST(ops->cntr_arm(R[r].arrivals, R[r].final));
		}
		uint64_t t0 = ops->clock_ps(&R[0].dom->fid);
		for (int r = 0; r < n; r++)
			MUST(fi_cntr_add(R[r].arrivals, 1));
		uint64_t t1 = t0;
		int reached[MAXR][2] = {{0}};
		for (int left = 2 * n; left;) {
			for (int r = 0; r < n; r++)
				for (int k = 0; k < 2; k++) {
					uint64_t ps;
					if (reached[r][k])
						continue;
					int got = ops->cntr_reached(k ? R[r].arrivals : R[r].done, &ps);
					if (got < 0) {
						fprintf(stderr, "rank %d: an operation failed (%d)\n", r,
							got);
						return 1;
					}
					if (got) {
						reached[r][k] = 1;
						left--;
						t1 = ps > t1 ? ps : t1;
					}
				}
			if (ops->clock_ps(&R[0].dom->fid) - t0 > 1000000000000ULL) {
				fprintf(stderr, "round %d did not finish in 1 s of device time\n",
					round);
				return 1;
			}
		}
		for (int r = 0; r < n; r++) {
			CHECK_EQ(fi_cntr_read(R[r].done), ops_done[r]);
			CHECK_EQ(fi_cntr_readerr(R[r].done), 0);
			CHECK_EQ(*R[r].word, expect);
		}
		total_ps += t1 - t0;
	}
	/* Nothing reached the endpoints' completion queues (no FI_COMPLETION). */
	for (int r = 0; r < n; r++)
		CHECK_EQ(fi_cq_read(R[r].cq, &e, 1), -FI_EAGAIN);
	printf("allreduce: %d ranks, %d rounds, latency %.3f us (simulated, mean)\n", n, ROUNDS,
	       total_ps / 1e6 / ROUNDS);
	fi_freeinfo(hints);
	fi_freeinfo(list);
	ct_name = "allreduce";
	return ct_summary_exit();
}
