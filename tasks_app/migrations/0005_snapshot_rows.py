# The snapshot of a running task becomes a series of appended rows (one per
# batch) instead of one row rewritten whole by every batch. Only running
# tasks have snapshots, and the service is not released yet, so the old rows
# are dropped rather than converted.

import django.db.models.deletion
from django.db import migrations, models

import tasks_app.fields


class Migration(migrations.Migration):
    dependencies = [
        ("tasks_app", "0004_task_finished_index"),
    ]

    operations = [
        migrations.DeleteModel(name="TaskSnapshot"),
        migrations.CreateModel(
            name="TaskSnapshot",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("sequence_number", models.IntegerField(help_text="The last event this row accounts for")),
                (
                    "token_ids",
                    tasks_app.fields.JSONTextField(default=list, help_text="Token ids generated since the previous row"),
                ),
                ("state", tasks_app.fields.JSONTextField(help_text="The generation's small state as of this row")),
                ("created_at", models.DateTimeField()),
                (
                    "task",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="snapshots",
                        to="tasks_app.task",
                    ),
                ),
            ],
            options={
                "db_table": "task_snapshots",
                "indexes": [models.Index(fields=["task", "id"], name="task_snapshot_order")],
            },
        ),
    ]
