"""Run several generated serve programs in one torchrun launch (argv[1]: a JSON list of
{"program", "argv"}), keeping the process group between them; tests use it to pay the
launch cost once for several layouts of the same world size."""

import gc
import importlib.util
import json
import sys

import torch.distributed as dist


def main() -> None:
    jobs = json.loads(sys.argv[1])
    for i, job in enumerate(jobs):
        spec = importlib.util.spec_from_file_location(f"serve_job_{i}", job["program"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main(job["argv"] + ["--keep-process-group"])
        dist.barrier()
    if dist.is_initialized():   # DESIGN: gc, barrier, then destroy
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
