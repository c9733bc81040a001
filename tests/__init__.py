import os

if "MUTANT_UNDER_TEST" in os.environ:  # (the mutation pass: in its test processes and pools' workers)
    from tests.mutation import private_trampolines

    private_trampolines()
