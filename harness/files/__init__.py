"""What a run folder holds: file names, columns, and how rows and JSON are written.

The bottom of harness: it imports nothing from harness but harness.errors, and every
subsystem that writes or reads a run folder (measure, drift, cluster, report) takes the
names, the writers and the resume check from here, so a writer and the report never
disagree about a column.
"""

from harness.files.columns import (EXACT_PATHS, MAPS, META, MODEL_COLUMNS, MODEL_CSV, MODEL_META,
                                   RESULT_COLUMNS, RESULTS, ROUNDS, SPREAD_FLAG, TRAIN_COLUMNS,
                                   TRAIN_CSV, TRAIN_LATER_COLUMNS, TRAIN_META)
from harness.files.csvlog import CsvLog, now, write_json
from harness.files.resume import check_folder

__all__ = ["EXACT_PATHS", "MAPS", "META", "MODEL_COLUMNS", "MODEL_CSV", "MODEL_META",
           "RESULT_COLUMNS", "RESULTS", "ROUNDS", "SPREAD_FLAG", "TRAIN_COLUMNS", "TRAIN_CSV",
           "TRAIN_LATER_COLUMNS", "TRAIN_META", "CsvLog", "check_folder", "now", "write_json"]
