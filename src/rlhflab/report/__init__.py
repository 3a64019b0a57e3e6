"""Reports: read run folders (never torch) and write self-contained HTML pages.

`write_report(run_dir)` writes `run_dir/report.html`; `write_comparison(run_dirs, out)`
writes one page comparing several runs. Both read only the files of the run folder.
"""

from rlhflab.report.compare import write_comparison
from rlhflab.report.runfolder import RunFolder, check_run_folder, is_run_folder, load_run
from rlhflab.report.single import write_report

__all__ = ["RunFolder", "check_run_folder", "is_run_folder", "load_run", "write_comparison", "write_report"]
