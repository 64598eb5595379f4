import os, time, torch, torch.distributed as dist, torch.multiprocessing as mp
def run(rank, n=300):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.zeros(8*512)
    for it in range(2):
        dist.barrier(); t0=time.perf_counter()
        for i in range(n):
            if rank==0: dist.send(t,1); dist.recv(t,1)
            else: dist.recv(t,0); dist.send(t,0)
        dt=(time.perf_counter()-t0)/n
    if rank==0: print(f"gloo rtt {dt*1e6:.0f} us")
    # post cost: isend of an irecv already posted
    dist.barrier()
    if rank==0:
        t0=time.perf_counter(); ws=[dist.isend(t,1) for _ in range(100)]; t1=time.perf_counter()
        for w in ws: w.wait()
        print(f"isend post {(t1-t0)/100*1e6:.0f} us")
    else:
        rs=[torch.empty_like(t) for _ in range(100)]
        t0=time.perf_counter(); ws=[dist.irecv(r,0) for r in rs]; t1=time.perf_counter()
        for w in ws: w.wait()
        print(f"irecv post {(t1-t0)/100*1e6:.0f} us")
    dist.destroy_process_group()
if __name__=="__main__":
    mp.spawn(run, nprocs=2)
