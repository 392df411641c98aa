"""The emulated-host tests' checks: each prints ok/FAIL with what it checked, and a failure shows
the end of the output it was judged on."""


class Checks:
    def __init__(self, tail=4000):
        self.failures, self.tail = [], tail

    def __call__(self, ok, what, out=""):
        print(("ok:   " if ok else "FAIL: ") + what, flush=True)
        if not ok:
            self.failures.append(what)
            print(out[-self.tail:])

    def exit_code(self):
        return 1 if self.failures else 0
